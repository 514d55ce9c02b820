"""``LeaseWorker``: the rq worker class that makes every stage live by construction.

Start it with ``rq worker -w streamrl.workers.LeaseWorker srl-rollout`` (``streamrl worker``
does). The invariant it keeps:

    Whenever a LeaseWorker is idle, every listed run (not halted) that has work for one of
    the worker's queues (entries not yet delivered, or delivered and not yet acked) has a
    lease job waiting on that queue; the idle worker then takes one itself.

Lease jobs still queue a successor as they start and end (while their run has work), but
liveness no longer rests on that chain: a lease killed with its worker (between dequeue and
top-up, at lease end, every lease of a queue at once) leaves nothing behind that anyone must
restart, because any idle worker, or any worker started later, recreates the lease within
``IDLE_CHECK_S``. The entries a dead lease held are reclaimed from the consumer group by the
next lease (``XAUTOCLAIM`` after ``claim_idle_ms``), so no stream entry depends on a
particular process surviving.

It also differs from rq's plain ``Worker`` in ways a long run needs:

- it reads and writes jobs with rq's JSON serializer, whatever ``-S`` says (no pickle);
- it heartbeats every ``WORKER_HEARTBEAT_S`` while idle or busy, so ``streamrl status`` can
  count only live workers (a SIGKILLed worker's registration lingers in rq until its key
  expires);
- its Redis client reconnects with backoff, so a restarted ``redis-server`` is ridden out
  instead of ending the worker;
- a worker whose leases keep failing (a config that cannot load, a stale policy) backs off
  exponentially before queueing another, instead of spinning.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from typing import Any

import redis
from redis.exceptions import NoPermissionError
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer
from rq.worker import Worker

from streamrl.bus import eviction
from streamrl.bus.keys import Keys
from streamrl.bus.shards import run_shards
from streamrl.connection import make_resilient
from streamrl.defaults import (
    IDLE_CHECK_S,
    LEASE_FAILURE_BACKOFF_MAX_S,
    RUNS_KEY,
    WORKER_HEARTBEAT_S,
    WORKER_TTL_S,
)
from streamrl.workers import leases
from streamrl.workers.context import data_connection


def _listed_runs(r: redis.Redis) -> list[str]:
    """Runs that want leases: listed, configured, and not halted. A run whose config is gone
    (deleted, flushed) is unlisted on the way."""
    runs = sorted(x.decode() for x in r.smembers(RUNS_KEY))
    if not runs:
        return []
    pipe = r.pipeline(transaction=False)
    for run in runs:
        pipe.exists(Keys(run).config)
        pipe.exists(Keys(run).halt)
    flags = pipe.execute(raise_on_error=False)
    out = []
    for i, run in enumerate(runs):
        configured, halted = flags[2 * i], flags[2 * i + 1]
        if isinstance(configured, NoPermissionError) or isinstance(halted, NoPermissionError):
            continue  # a per-run ACL user (``streamrl acl``): another run's, not ours
        if isinstance(configured, Exception) or isinstance(halted, Exception):
            raise configured if isinstance(configured, Exception) else halted
        if not configured:
            with contextlib.suppress(NoPermissionError):  # the operator unlists it then
                r.srem(RUNS_KEY, run)
        elif not halted:
            out.append(run)
    return out


def ensure_leases(r: redis.Redis, queue_names: list[str], data: object = None) -> int:
    """Queue a lease on rq's Redis ``r`` for every listed run that has work on each of these
    queues and no lease waiting there. Runs and their work are read from ``data``, the data
    Redis (a Redis Cluster, say), when that is another server."""
    names = [q for q in queue_names if q in leases.ROLES]
    if not names:
        return 0
    d = r if data is None else data
    added = 0
    for run in _listed_runs(d):  # type: ignore[arg-type]
        for keys in run_shards(d, run):
            for name in names:
                if leases.has_work(d, name, keys):  # type: ignore[arg-type]
                    added += leases.top_up(r, name, run, data=data, shard=keys.shard)
    return added


class LeaseWorker(Worker):
    def __init__(self, queues: Any, *args: Any, **kwargs: Any) -> None:
        # Always JSON: lease jobs are enqueued as JSON, and nothing read from Redis is ever
        # unpickled. rq's CLI defaults -S to pickle, so its flag cannot be trusted here.
        kwargs["serializer"] = JSONSerializer
        super().__init__(queues, *args, **kwargs)
        for q in self.queues:  # the CLI built these with its -S flag
            q.serializer = self.serializer
        make_resilient(self.connection)
        # the runs' data Redis when it is not rq's (STREAMRL_DATA_URL: a Redis Cluster)
        self.data = data_connection(self.connection)
        try:
            eviction.check(self.data, "rq worker")
        except eviction.EvictingRedis as e:  # rq's command line prints it and exits 1
            raise SystemExit(f"Error: {e}") from None
        self.job_monitoring_interval = min(self.job_monitoring_interval, WORKER_HEARTBEAT_S)
        self.worker_ttl = min(self.worker_ttl, WORKER_TTL_S)
        self._failures = 0  # consecutive failed leases run by this worker
        # Import the lease code now, in the process that forks the work horses: a horse then
        # runs the code its worker started with. Imported in the horse, a newer file on disk
        # (an upgrade under running workers) met older modules already loaded here, and every
        # lease failed (AttributeError) until the worker was restarted.
        for name in self.queue_names():
            if name in leases.ROLES:
                importlib.import_module(leases.ROLES[name].rsplit(".", 1)[0])
        # STREAMRL_PRELOAD=torch,transformers: heavy imports a backend will need, paid once
        # here while the worker idles (e.g. while the model is still being built) instead of
        # in every work horse; only imports, no threads, so forking stays safe
        for module in filter(None, os.environ.get("STREAMRL_PRELOAD", "").split(",")):
            importlib.import_module(module.strip())
        self._ensure_after = 0.0  # monotonic time before which this worker queues no lease

    # -- the invariant
    def _ensure(self) -> None:
        if time.monotonic() < self._ensure_after:
            return
        try:
            data = None if self.data is self.connection else self.data
            ensure_leases(self.connection, self.queue_names(), data=data)
        except redis.RedisError as e:  # Redis is down: rq's own loop reconnects with backoff
            self.log.warning("Worker %s: could not ensure leases: %s", self.name, e)

    def dequeue_job_and_maintain_ttl(
        self, timeout: int | None, max_idle_time: int | None = None
    ) -> tuple[Job, Queue] | None:
        """rq's blocking dequeue, cut into ``IDLE_CHECK_S`` slices; before each slice the
        worker heartbeats and makes sure its runs have a lease waiting."""
        if timeout is None:  # burst mode: one non-blocking look
            self._ensure()
            return super().dequeue_job_and_maintain_ttl(None, max_idle_time)
        idle_since = time.monotonic()
        while True:
            self._ensure()
            result = super().dequeue_job_and_maintain_ttl(IDLE_CHECK_S, IDLE_CHECK_S)
            if result is not None or self._stop_requested:
                return result
            if max_idle_time is not None and time.monotonic() - idle_since >= max_idle_time:
                return None

    # -- backing off from leases that keep failing
    def execute_job(self, job: Job, queue: Queue) -> Any:
        out = super().execute_job(job, queue)
        try:
            failed = job.get_status(refresh=True) == JobStatus.FAILED
        except Exception:  # the job's key is gone (its TTL ran out): it did not fail
            failed = False
        if failed:
            self._failures += 1
            wait = min(LEASE_FAILURE_BACKOFF_MAX_S, 2.0 ** (self._failures - 1))
            self._ensure_after = time.monotonic() + wait
            self.log.warning(
                "Worker %s: lease %s failed (%d in a row); next lease in %.0f s",
                self.name,
                job.id,
                self._failures,
                wait,
            )
        else:
            self._failures = 0
            self._ensure_after = 0.0
        return out

    def maintain_heartbeats(self, job: Job, execution: Any) -> None:
        """A Redis restart while the horse runs must not end the worker (rq would quit on the
        exception): the horse carries on, and the next heartbeat catches up."""
        try:
            super().maintain_heartbeats(job, execution)
        except redis.ConnectionError as e:
            self.log.warning("Worker %s: heartbeat failed: %s", self.name, e)
