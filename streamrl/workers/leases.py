"""rq glue. rq is the process and control layer: it starts, counts and restarts workers; the
data travels on streams. A *lease job* is the only thing on an rq queue: one job consumes a
stream for a bounded time. While its run has work, every lease tops the queue up so that one
job always waits there, which is what lets ``rq worker`` processes be added or removed at any
time; idle ``LeaseWorker``s queue one when none waits (``lease_worker``), so that chain is a
fast path, not what liveness rests on.

Jobs are enqueued with rq's JSON serializer (workers run with ``-S json``), so nothing rq reads
from Redis is unpickled either.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer
from rq.worker import Worker

from streamrl.bus.keys import Keys
from streamrl.bus.values import as_str
from streamrl.defaults import (
    LEASE_DRAIN_SECONDS,
    LEASE_JOB_TIMEOUT_GRACE,
    LEASE_SECONDS,
    LEASE_YIELD_IDLE_S,
    WORKER_LIVE_S,
)

ROLES = {
    "srl-rollout": "streamrl.workers.rollout.lease",
    "srl-verify": "streamrl.workers.verify.lease",
}


def queue(r: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=r, serializer=JSONSerializer)


def _lease_timeout(r: redis.Redis, name: str, run: str, seconds: float | None = None) -> int:
    """rq's job timeout for one lease: the lease's length (``seconds``, else the run config's
    ``lease_seconds``), its drain, and a grace. rq kills a horse that runs past it, so a
    timeout taken from the default length cut every longer lease short (the demo's 600 s
    rollout leases died at 180 s, mid-episode)."""
    import msgspec

    from streamrl.bus.keys import Keys
    from streamrl.workers.context import read_config

    lease_s, drain_s = LEASE_SECONDS, LEASE_DRAIN_SECONDS
    try:
        cfg = read_config(r.get(Keys(run).config))
    except msgspec.DecodeError:  # the lease itself will fail and say why
        cfg = None
    if cfg is not None:
        stage = cfg.rollout if name == "srl-rollout" else cfg.verify
        lease_s = stage.lease_seconds
        if name == "srl-rollout":
            drain_s = cfg.rollout.drain_seconds
    if seconds is not None:
        lease_s = seconds
    return int(lease_s + drain_s + LEASE_JOB_TIMEOUT_GRACE)


def _enqueue(
    r: redis.Redis,
    name: str,
    run: str,
    seconds: float | None = None,
    data: object = None,
    shard: int | None = None,
) -> None:
    """Queue one lease on rq's Redis ``r``; ``data`` is the run's data Redis when that is
    another server (a Redis Cluster). A lease of a sharded run consumes one ``shard``."""
    args: tuple = (run, seconds) if shard is None else (run, seconds, shard)
    where = "" if shard is None else f" shard {shard}"
    queue(r, name).enqueue(
        ROLES[name],
        *args,
        job_timeout=_lease_timeout(data if data is not None else r, name, run, seconds),
        result_ttl=300,
        failure_ttl=24 * 3600,
        description=f"{name} lease for run {run!r}{where}",
    )


def _shard_of_job(job: Job) -> int | None:
    return job.args[2] if len(job.args) > 2 else None


def top_up(
    r: redis.Redis,
    name: str,
    run: str,
    waiting: int = 1,
    seconds: float | None = None,
    at_most_every_s: float = 0.0,
    data: object = None,
    shard: int | None = None,
) -> int:
    """Keep ``waiting`` lease jobs queued on rq's Redis ``r`` (``data``: the run's data Redis
    when it is another server), for one ``shard`` of a sharded run. Two leases racing here may
    both enqueue; a spare lease only means a worker picks it up a little early, so no lock is taken.
    ``at_most_every_s`` rate-limits a lease that tops up as it starts, so a lease that keeps
    crashing right after its start cannot spin its workers."""
    if at_most_every_s > 0:
        gate = f"srl:{{{run}}}:topup:{name}" + ("" if shard is None else f":{shard}")
        if not r.set(gate, 1, nx=True, px=int(at_most_every_s * 1000)):
            return 0
    q = queue(r, name)
    queued = sum(
        1 for job in q.get_jobs() if job.args and job.args[0] == run and _shard_of_job(job) == shard
    )
    missing = max(0, waiting - queued)
    for _ in range(missing):
        _enqueue(r, name, run, seconds, data=data, shard=shard)
    return missing


def others_waiting(r: redis.Redis, name: str, run: str, shard: int | None) -> bool:
    """Whether the queue holds a lease for another run or another shard than ``run``'s
    ``shard``: a lease that is waiting for a worker while this one has nothing to do."""
    return any(
        job.args and (job.args[0], _shard_of_job(job)) != (run, shard)
        for job in queue(r, name).get_jobs()
    )


class IdleYield:
    """When a lease with nothing to do hands its worker over. A lease holds its worker for its
    whole ``lease_seconds``; with fewer workers than shards (or runs), one whose shard had
    drained idled out its 30 s while the next shard's tasks waited for a worker. After
    ``idle_s`` with nothing done, it asks ``others`` (at most once per ``idle_s``) whether
    another lease waits, and ends if one does."""

    def __init__(self, others: Callable[[], bool], idle_s: float = LEASE_YIELD_IDLE_S):
        self.others = others
        self.idle_s = idle_s
        self._idle_since: float | None = None
        self._next_ask = 0.0

    def busy(self) -> None:
        self._idle_since = None

    def should_end(self, now: float | None = None) -> bool:
        """Called after a pass that did nothing."""
        now = time.monotonic() if now is None else now
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self.idle_s or now < self._next_ask:
            return False
        self._next_ask = now + self.idle_s
        try:
            return self.others()
        except redis.RedisError:  # rq's Redis unreachable: keep the lease, as without this
            return False


def idle_yield(control: redis.Redis, name: str, run: str, shard: int | None) -> IdleYield:
    """The ``IdleYield`` of a lease of ``run``'s ``shard`` on queue ``name`` (rq's Redis:
    ``control``)."""
    return IdleYield(lambda: others_waiting(control, name, run, shard))


def top_up_shards(
    r: redis.Redis,
    name: str,
    run: str,
    waiting: int = 1,
    seconds: float | None = None,
    data: object = None,
) -> int:
    """``top_up`` for every shard of the run (once when unsharded)."""
    from streamrl.bus.shards import run_shards

    return sum(
        top_up(r, name, run, waiting, seconds, data=data, shard=keys.shard)
        for keys in run_shards(data if data is not None else r, run)
    )


def top_up_if_work(
    r: redis.Redis,
    name: str,
    run: str,
    at_most_every_s: float = 0.0,
    control: redis.Redis | None = None,
    shard: int | None = None,
) -> int:
    """``top_up`` for a run that is not halted and still has work on this queue. Leases call it
    as they start (so a second worker finds a lease while the first is busy) and as they end;
    a run with nothing left gets no successor, so an idle run does not keep a chain of empty
    leases turning (idle ``LeaseWorker``s queue one again when work arrives)."""
    from streamrl.bus.shards import keys_of_shard, shard_count

    keys = keys_of_shard(run, shard, shard_count(r, run))
    if keys is None or r.exists(keys.halt) or not has_work(r, name, keys):
        return 0
    if control is None or control is r:
        return top_up(r, name, run, at_most_every_s=at_most_every_s, shard=shard)
    return top_up(control, name, run, at_most_every_s=at_most_every_s, data=r, shard=shard)


def has_work(r: redis.Redis, name: str, keys: Keys) -> bool:
    """Whether the stream this queue's leases read has entries not yet delivered, or entries
    delivered and not yet acked (held by a live lease, or left by a dead one to reclaim).
    A run with neither needs no lease: leases for idle runs would only take turns on the
    workers with the runs that have work. A run whose policy fault is set needs rollout
    leases too: only a lease that loads the policy again can clear it."""
    from streamrl.defaults import ROLLOUT_GROUP, VERIFY_GROUP

    stream, group = {
        "srl-rollout": (keys.tasks, ROLLOUT_GROUP),
        "srl-verify": (keys.rollouts, VERIFY_GROUP),
    }[name]
    if name == "srl-rollout" and r.exists(keys.fault):
        return True
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:  # no stream yet
        return False
    for g in groups:
        gname = as_str(g["name"])
        if gname == group:
            lag = g.get("lag")  # None when Redis cannot tell (after XDEL / trimming)
            return lag is None or lag > 0 or g.get("pending", 0) > 0
    return False


def workers(r: redis.Redis, name: str) -> list[Worker]:
    """Every worker rq has registered on the queue, dead ones included (see ``live``)."""
    return Worker.all(queue=queue(r, name))


def _is_live(worker: Worker, now: float | None = None) -> bool:
    """Alive by rq's heartbeat: a SIGKILLed worker stays registered until its key expires,
    but stops heartbeating at once."""
    beat = worker.last_heartbeat
    if beat is None:
        return False
    now = time.time() if now is None else now
    return now - beat.replace(tzinfo=beat.tzinfo or UTC).timestamp() <= WORKER_LIVE_S


def queue_health(r: redis.Redis, name: str) -> dict:
    """Per queue: live workers, how many of them are busy, leases waiting, failed leases."""
    now = time.time()
    registered = workers(r, name)
    live = [w for w in registered if _is_live(w, now)]
    return {
        "workers": len(live),
        "busy": sum(1 for w in live if _state(w) == "busy"),
        "registered": len(registered),
        "queued_leases": queue(r, name).count,
        **failures(r, name),
    }


def _state(w: Worker) -> str:
    return as_str(w.get_state())


def failures(r: redis.Redis, name: str) -> dict:
    """How many lease jobs failed, and the last line of the newest failure: a lease that
    crashes at start (a bad config, a backend that cannot load) shows up here."""
    registry = queue(r, name).failed_job_registry
    ids = registry.get_job_ids(cleanup=False)  # a read: the observer's user may not write
    last = ""
    if ids:
        job = Job.fetch(ids[-1], connection=r, serializer=JSONSerializer)
        result = job.latest_result()
        lines = ((result.exc_string if result else "") or "").strip().splitlines()
        last = lines[-1] if lines else ""
    return {"failed_leases": len(ids), "last_failure": last}


def run_lease(
    run: str,
    name: str,
    stage: str,
    body: Callable[[redis.Redis], dict],
    shard: int | None = None,
) -> dict:
    """What every lease job does around its work: stop at once when the run is halted, log
    with the run and worker bound, and queue a successor when done (not when halted)."""
    import structlog

    from streamrl.bus.keys import Keys
    from streamrl.log import configure
    from streamrl.workers.context import consumer_name, control_connection, data_connection

    control = control_connection()
    conn = data_connection(control)
    halt = Keys(run).halt
    if conn.exists(halt):
        return {"halted": True}
    configure()
    structlog.contextvars.bind_contextvars(run=run, role=stage, worker=consumer_name())
    if shard is not None:
        structlog.contextvars.bind_contextvars(shard=shard)
    counts = body(conn)
    top_up_if_work(conn, name, run, control=control, shard=shard)
    return counts
