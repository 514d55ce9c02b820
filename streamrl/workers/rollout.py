"""The rollout worker: an rq *lease job* that consumes the ``tasks`` stream for a bounded time,
running many episodes concurrently with asyncio.

Start workers with ``rq worker -w streamrl.workers.LeaseWorker srl-rollout`` (or ``streamrl
worker rollout``); an idle LeaseWorker queues a lease for every run that has none waiting, so
every worker always holds one and a new worker starts pulling tasks with no other action.
The worker keeps nothing between episodes: each episode's session is checkpointed to Redis
after every turn, and an episode whose worker died is reclaimed by another worker after
``claim_idle_ms`` and resumed from its last committed turn.

Kept whole: a lease's episodes, claims, heartbeats, batched writes and policy share its state.

An environment that drives its own episodes (nemo-gym ``mode=run``: an environment server's
agent calls "the model" over HTTP) gets the worker's policy served at its address
(``streamrl.policy.endpoint``), started on first use and stopped with the lease.

Policy health (``streamrl.workers.policy_watch``): a lease starts by loading the newest
announced policy version; every heartbeat asks the backend to look for a newer one and records
the version it serves and its last reload error in the run's ``policy_health`` hash. A worker
more than ``max_staleness`` versions behind for longer than ``rollout.max_policy_lag_s`` stops
taking tasks, cancels its episodes (their entries stay pending, for other workers to reclaim),
sets the run's fault and fails the lease with ``PolicyStale``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import structlog

from streamrl import schema, session_codec
from streamrl.bus import health
from streamrl.bus.keys import Keys
from streamrl.bus.shards import NO_SUCH_SHARD, keys_of_shard
from streamrl.bus.streams import (
    Entry,
    Scripts,
    claim_args,
    dead_letter,
    deadletter_call,
    heartbeat_args,
    parse_claim,
    parse_read,
)
from streamrl.config import RunConfig
from streamrl.defaults import ROLLOUT_GROUP, ROLLOUT_QUEUE
from streamrl.envs import EnvUnavailable
from streamrl.envs.external import abandon
from streamrl.policy import PolicyError, make_policy
from streamrl.policy.base import Policy
from streamrl.policy.endpoint import Endpoints
from streamrl.workers import leases
from streamrl.workers.batcher import Batcher
from streamrl.workers.context import (
    async_twin,
    consumer_name,
    control_connection,
    data_url,
    read_config,
)
from streamrl.workers.envs import EnvTable
from streamrl.workers.episode import LostClaim, anew_session, finish, run_episode
from streamrl.workers.policy_watch import PolicyWatch

log = structlog.get_logger("streamrl.rollout")


class _DeadLetter(msgspec.Struct, frozen=True):
    """An episode's outcome when its task can never be played: why, for the dead letters."""

    reason: str


class _RolloutLease:
    def __init__(
        self,
        r: Any,
        run: str,
        consumer: str,
        seconds: float | None = None,
        on_ready: Any = None,
        url: str | None = None,
        shard: int | None = None,
        idle: leases.IdleYield | None = None,
    ):
        self.on_ready = on_ready
        # ends the lease early: idle, while another lease waits (never, when none is given)
        self.idle = idle or leases.IdleYield(lambda: False)
        self.url = url
        self.r = r
        self.keys = Keys(run)  # the run's; this lease's shard once the run's config is read
        self.shard = shard
        self.run_name = run
        self.consumer = consumer
        self.seconds = seconds
        self.scripts = Scripts(r)
        self.held: dict[str, Entry] = {}
        self.active: dict[str, asyncio.Task] = {}
        self.slot = asyncio.Event()
        self.counts = {"finished": 0, "lost_claim": 0, "dead_lettered": 0, "policy_errors": 0}
        self.commits: Batcher = Batcher(self._flush_commits)
        # per held entry: how much of its session the value in Redis holds (appends go after)
        self.marks: dict[str, session_codec.SessionMark] = {}
        self._codec: session_codec.SessionCodec | None = None
        self.finishes: Batcher = Batcher(self._flush_finishes)
        self.cursor = "0-0"
        self.watch = PolicyWatch(r, self.keys, consumer, wake=self.slot)
        self.endpoints: Endpoints | None = None  # the policy served over HTTP (mode=run)

    def codec(self) -> session_codec.SessionCodec:
        """Sessions packed with the policy's tokenizer, when it has one (``session_codec``)."""
        if self._codec is None:
            policy: Policy | None = getattr(self, "policy", None)
            if policy is None:  # no policy yet: nothing to lean on (a lease built by hand)
                return session_codec.SESSION
            self._codec = session_codec.SessionCodec(policy.session_tokens())
        return self._codec

    # ---------------------------------------------------------------- Redis calls (batched)
    async def _flush_commits(self, items: list[tuple[Entry, schema.Session]]) -> list[int]:
        """Checkpoint sessions: each appends a frame with what changed since its last
        checkpoint (``session_codec``); one whose value in Redis is not the one this worker
        appends to (it expired) is written whole."""
        res = await self._commit([(e, s, self.marks.get(e.id)) for e, s in items])
        again = [i for i, r in enumerate(res) if r == 2]
        if again:
            redo = await self._commit([(items[i][0], items[i][1], None) for i in again])
            for i, r in zip(again, redo, strict=True):
                res[i] = r
        return [int(r == 1) for r in res]

    async def _commit(
        self, items: list[tuple[Entry, schema.Session, session_codec.SessionMark | None]]
    ) -> list[int]:
        keys = [self.keys.tasks] + [self.keys.session(e.task_id) for e, _, _ in items]
        args: list[Any] = [ROLLOUT_GROUP, self.consumer, self.config.rollout.session_ttl_s]
        marks = []
        for e, s, mark in items:
            frame, after = self.codec().frame(s, mark, e.payload)
            args += [e.id, e.fence, frame]
            marks.append(after)
        res = list(await self.scripts.commit(keys=keys, args=args))
        for (e, _, _), r, after in zip(items, res, marks, strict=True):
            if r == 1:
                self.marks[e.id] = after
        return res

    async def _flush_finishes(self, items: list[tuple[Entry, schema.Trajectory]]) -> list[int]:
        k = self.keys
        keys = [k.tasks, k.rollouts, k.stats] + [k.session(e.task_id) for e, _ in items]
        args: list[Any] = [ROLLOUT_GROUP, self.consumer]
        for e, t in items:
            args += [e.id, e.fence, e.task_id, schema.encode(t)]
        return await self.scripts.finish(keys=keys, args=args)

    async def _deadletter(self, entry: Entry, reason: str) -> None:
        keys, args = deadletter_call(
            self.keys, self.keys.tasks, ROLLOUT_GROUP, self.consumer,
            [(entry, dead_letter(entry, "rollout", reason), b"")],
            with_session=True, done_ttl_s=self.config.streams.group_done_ttl_s,
        )  # fmt: skip
        done = await self.scripts.deadletter(keys=keys, args=args)
        if done and done[0]:
            self.counts["dead_lettered"] += 1
            log.warning("dead-lettered task", task_id=entry.task_id, reason=reason)

    async def _claim(self, own: bool, count: int) -> list[Entry]:
        args = claim_args(
            ROLLOUT_GROUP,
            self.consumer,
            self.config.streams.claim_idle_ms,
            count,
            self.cursor,
            own,
            self.keys.session(""),
        )
        cursor, entries = parse_claim(await self.scripts.claim(keys=[self.keys.tasks], args=args))
        if not own:
            self.cursor = cursor
        if entries:
            log.info("claimed", count=len(entries), own=own, consumer=self.consumer)
        return entries

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.streams.heartbeat_s)
            await self.watch.heartbeat(self.policy, self.config)
            held = list(self.held.values())
            if not held:
                continue
            lost = await self.scripts.heartbeat(
                keys=[self.keys.tasks], args=heartbeat_args(ROLLOUT_GROUP, self.consumer, held)
            )
            for raw in lost:
                eid = raw.decode()
                task = self.active.get(eid)
                if task is not None:
                    task.cancel()
                    self.counts["lost_claim"] += 1

    # ---------------------------------------------------------------- episodes
    def _env(self, name: str):
        """Tasks name their environment; a run may mix several (``workers.envs``)."""
        return self.table.env(name)

    def _start(self, entries: list[Entry]) -> None:
        for e in entries:
            if e.id in self.active:
                continue
            self.held[e.id] = e
            self.active[e.id] = asyncio.create_task(self._episode(e))

    async def _episode(self, entry: Entry) -> None:
        """One delivered task, start to release. Its outcome is a trajectory (written with the
        last turn), a dead letter, or an exception: then nothing is written and the entry stays
        pending for a retry."""
        # each asyncio task runs in its own copy of the context: this binding is per episode
        structlog.contextvars.bind_contextvars(
            task_id=entry.task_id, rollout_id=entry.id, policy_version=self.policy.version
        )
        try:
            await self._settle(entry, await self._outcome(entry))
        except (Exception, asyncio.CancelledError) as e:
            self._left_pending(entry, e)
        finally:
            self._release(entry)

    async def _outcome(self, entry: Entry) -> schema.Trajectory | _DeadLetter:
        """Admit the delivery, resume or open its session, play the turns."""
        most = self.config.streams.max_deliveries
        if entry.fence > most:
            await abandon(self._env, entry.payload, entry.session)  # its server session
            return _DeadLetter(
                f"delivered {entry.fence} times (max {most}): its "
                "workers died or its policy kept failing"
            )
        try:
            task = schema.check_version(schema.TASK.decode(entry.payload))
        except msgspec.DecodeError as e:
            return _DeadLetter(f"undecodable task: {e}")
        return await self._play(entry, task, self._resumed(entry))

    def _resumed(self, entry: Entry) -> schema.Session | None:
        """The session a previous claim checkpointed; None starts the episode afresh."""
        if not entry.session:
            return None
        try:
            session, mark = self.codec().decode_marked(entry.session, entry.payload)
        except msgspec.DecodeError as e:
            log.warning("unreadable session, restarting episode", error=str(e))
            return None
        if mark is not None:  # the next checkpoint appends to what was read
            self.marks[entry.id] = mark
        session.claims += 1
        session.resumed_from_turn = len(session.turns)
        return session

    async def _play(
        self, entry: Entry, task: schema.Task, session: schema.Session | None
    ) -> schema.Trajectory | _DeadLetter:
        """Run the turns. What the environment raises is judged here: a service that is down
        dead-letters the task (infrastructure, never scored), anything else is a failed
        trajectory. A lost claim and the policy's failures pass through, for a retry."""
        try:
            await self.table.look_up(task.env, lambda: self.r.get(self.keys.mix))  # `mix`
            env = self._env(task.env)
            if session is None:
                session = await anew_session(env, task)
            commit = lambda s: self.commits.submit((entry, s))  # noqa: E731
            endpoint = await self._endpoint(env)
            return await run_episode(
                env, self.policy, task, session, commit, self.config.rollout,
                worker=self.consumer, endpoint=endpoint,
            )  # fmt: skip
        except (LostClaim, PolicyError):
            raise
        except EnvUnavailable as e:
            return _DeadLetter(f"environment unavailable: {e}")
        except Exception as e:  # the environment broke on this task
            if session is None:
                session = schema.Session(task_id=task.task_id, items=list(task.input))
            reason = f"environment error: {type(e).__name__}: {e}"
            return finish(task, session, "failed", worker=self.consumer, failure=reason)

    async def _endpoint(self, env: Any) -> Any:
        """The policy endpoint an environment that drives its own episodes calls (None for the
        others); one that cannot listen is a policy failure: the task is left for a retry."""
        if not getattr(env, "serves_episodes", False):  # the worker drives the episode itself
            return None
        try:
            return await self.endpoints.for_env(env)
        except OSError as e:
            raise PolicyError(str(e)) from e

    async def _settle(self, entry: Entry, outcome: schema.Trajectory | _DeadLetter) -> None:
        """Write the outcome, fenced: a worker that lost the claim meanwhile writes nothing."""
        if isinstance(outcome, _DeadLetter):
            await self._deadletter(entry, outcome.reason)
        elif await self.finishes.submit((entry, outcome)):
            self.counts["finished"] += 1
        else:
            self.counts["lost_claim"] += 1

    def _left_pending(self, entry: Entry, error: BaseException) -> None:
        """Nothing was written: the entry stays pending, retried after ``claim_idle_ms`` (and
        dead-lettered after ``max_deliveries``). A cancel (lost claim, lease end) is silent."""
        if isinstance(error, LostClaim):
            self.counts["lost_claim"] += 1
        elif isinstance(error, PolicyError):
            # infrastructure, not the model's fault
            self.counts["policy_errors"] += 1
            log.error("policy failed; task left for retry", task_id=entry.task_id, error=str(error))
        elif not isinstance(error, asyncio.CancelledError):
            log.exception(
                "rollout worker error; task left for retry", task_id=entry.task_id, exc_info=error
            )

    def _release(self, entry: Entry) -> None:
        self.held.pop(entry.id, None)
        self.marks.pop(entry.id, None)
        self.active.pop(entry.id, None)
        self.slot.set()

    # ---------------------------------------------------------------- the lease
    async def _wait_config(self, until: float) -> RunConfig | None:
        while time.monotonic() < until:
            cfg = read_config(await self.r.get(self.keys.config))
            if cfg is not None:
                return cfg
            await asyncio.sleep(0.5)
        return None

    async def run(self) -> dict[str, Any]:
        started = time.monotonic()
        probe_until = started + (self.seconds or 30.0)
        cfg = await self._wait_config(probe_until)
        if cfg is None:
            log.info("no config for run yet; lease ends", run=self.run_name)
            return self.counts
        keys = keys_of_shard(self.run_name, self.shard, cfg.streams.shards)
        if keys is None:
            log.info(NO_SUCH_SHARD, shard=self.shard, shards=cfg.streams.shards)
            return self.counts
        self.keys, self.config = keys, cfg
        self.table = EnvTable(cfg)
        self.policy = make_policy(
            cfg.policy,
            self.table.env(cfg.envs[0].name if cfg.envs else cfg.env),
            redis_url=self.url,
            run=self.run_name,
            env_for=self._env,
            worker=self.consumer,
        )
        self.endpoints = Endpoints(self.policy)
        rc = cfg.rollout
        end = started + (self.seconds if self.seconds is not None else rc.lease_seconds)
        heartbeat = None
        try:
            # the run's environments that drive their own episodes get the policy endpoint
            # before any task is taken: a worker that cannot listen there fails its lease
            for name in [e.name for e in cfg.envs] or [cfg.env]:
                try:
                    env = self.table.env(name)
                except Exception:  # built again by its first task, which dead-letters it as before
                    continue
                await self.endpoints.for_env(env)
            await self.watch.load()
            await self.policy.refresh()  # serve the newest version from the first task on
            await self.watch.check(self.policy, self.config)
            if self.watch.stale is None:
                # a lease that fails here queues no successor: the worker's backoff decides
                if self.on_ready is not None:
                    self.on_ready()
                # visible in XINFO CONSUMERS (and `streamrl status`) before its first delivery
                await self.r.xgroup_createconsumer(self.keys.tasks, ROLLOUT_GROUP, self.consumer)
                heartbeat = asyncio.create_task(self._heartbeat_loop())
                await self._consume(end)
        finally:
            if heartbeat is not None:
                heartbeat.cancel()
            await self.watch.aclose()
            await self.endpoints.stop()
            await self.policy.close()
            for env in self.table.envs.values():
                try:
                    await env.aclose()
                except Exception as e:  # a pool that will not close must not fail the lease
                    log.warning("environment close failed", env=env.name, error=repr(e))
        if self.watch.stale is not None:
            log.error("policy too stale; lease fails", reason=self.watch.stale, **self.counts)
            raise health.PolicyStale(self.watch.stale)
        log.info("lease done", run=self.run_name, consumer=self.consumer, **self.counts)
        return self.counts

    async def _consume(self, end: float) -> None:
        """Run episodes until the lease's end, a halt, or the staleness guard trips (then the
        episodes are cancelled at once: their entries stay pending for other workers)."""
        cfg, rc = self.config, self.config.rollout
        self._start(await self._claim(own=True, count=rc.max_concurrent))
        next_stale = next_halt = 0.0
        low_water = max(1, min(rc.read_batch, rc.max_concurrent) // 2)
        topping = False  # a few free slots waited for a freed one long enough: read for them
        while time.monotonic() < end and self.watch.stale is None:
            cap = rc.max_concurrent - len(self.active)
            if (cap <= 0 or (cap < low_water and not topping)) and self.active:
                # wait for episodes to end rather than read a handful of tasks at a time, but
                # no longer than a read would block: free slots must not sit idle for a whole
                # episode while tasks wait (a read that came back short while the producer was
                # still pushing left a worker of 10,000 slots 720 short for 20 s)
                self.slot.clear()
                wait = end - time.monotonic()
                if cap > 0:
                    wait = min(wait, cfg.streams.block_ms / 1000)
                try:
                    await asyncio.wait_for(self.slot.wait(), timeout=max(0.0, wait))
                except TimeoutError:
                    if time.monotonic() >= end:
                        break
                    topping = True
                continue
            topping = False
            now = time.monotonic()
            if now >= next_halt:
                next_halt = now + 0.5
                if await self.r.exists(self.keys.halt):
                    break
            if now >= next_stale:
                next_stale = now + max(0.2, cfg.streams.claim_idle_ms / 2000)
                self._start(await self._claim(own=False, count=cap))
                cap = rc.max_concurrent - len(self.active)
                if cap <= 0:
                    continue
            block = int(min(cfg.streams.block_ms, max(1.0, (end - now) * 1000)))
            resp = await self.r.xreadgroup(
                ROLLOUT_GROUP,
                self.consumer,
                {self.keys.tasks: ">"},
                count=min(cap, rc.read_batch),
                block=block,
            )
            read = parse_read(resp)
            if self.watch.stale is None:  # else left pending, for other workers to claim
                self._start(read)
            if read or self.active:
                self.idle.busy()
            elif self.idle.should_end():
                log.info("lease ends early: nothing to do here, another lease waits")
                break
        if self.active and self.watch.stale is None:
            await asyncio.wait(list(self.active.values()), timeout=rc.drain_seconds)
        for task in list(self.active.values()):
            task.cancel()


def lease(run: str, seconds: float | None = None, shard: int | None = None) -> dict[str, Any]:
    """The rq job: consume tasks (of one shard of a sharded run) for one lease, then hand the
    worker back to rq."""
    return leases.run_lease(
        run,
        ROLLOUT_QUEUE,
        "rollout",
        lambda conn: asyncio.run(_lease(conn, run, seconds, shard)),
        shard=shard,
    )


async def _lease(conn: Any, run: str, seconds: float | None, shard: int | None) -> dict[str, Any]:
    r = async_twin(conn)
    control = control_connection()
    try:
        ready = lambda: leases.top_up_if_work(  # noqa: E731
            conn, ROLLOUT_QUEUE, run, at_most_every_s=1.0, control=control, shard=shard
        )
        url = data_url(control)
        idle = leases.idle_yield(control, ROLLOUT_QUEUE, run, shard)
        lease = _RolloutLease(
            r, run, consumer_name(), seconds, on_ready=ready, url=url, shard=shard, idle=idle
        )
        return await lease.run()
    finally:
        await r.aclose()
