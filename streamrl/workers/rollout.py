"""The rollout worker: an rq *lease job* that consumes the ``tasks`` stream for a bounded time,
running many episodes concurrently with asyncio.

Start workers with ``rq worker -w streamrl.workers.LeaseWorker srl-rollout`` (or ``streamrl
worker rollout``); an idle LeaseWorker queues a lease for every run that has none waiting, so
every worker always holds one and a new worker starts pulling tasks with no other action.
The worker keeps nothing between episodes: each episode's session is checkpointed to Redis
after every turn, and an episode whose worker died is reclaimed by another worker after
``claim_idle_ms`` and resumed from its last committed turn.

Policy health (``streamrl.bus.health``): a lease starts by loading the newest announced policy
version, and on every heartbeat asks the backend to look for a newer one and records the version
it serves and its last reload error in the run's ``policy_health`` hash. A worker that stays
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

from streamrl import schema
from streamrl.bus import health
from streamrl.bus.keys import Keys
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
from streamrl.envs import EnvUnavailable, make_env
from streamrl.policy import PolicyError, make_policy
from streamrl.policy._versions import latest_version
from streamrl.workers import leases
from streamrl.workers.batcher import Batcher
from streamrl.workers.context import (
    async_twin,
    consumer_name,
    control_connection,
    data_url,
    read_config,
)
from streamrl.workers.episode import LostClaim, anew_session, finish, run_episode

log = structlog.get_logger("streamrl.rollout")


class RolloutLease:
    def __init__(
        self,
        r: Any,
        run: str,
        consumer: str,
        seconds: float | None = None,
        on_ready: Any = None,
        url: str | None = None,
        shard: int | None = None,
    ):
        self.on_ready = on_ready
        self.url = url
        self.r = r
        self.keys = Keys(run, shard)  # this lease's shard; run-wide keys keep the run's tag
        self.run_name = run
        self.consumer = consumer
        self.seconds = seconds
        self.scripts = Scripts(r)
        self.held: dict[str, Entry] = {}
        self.active: dict[str, asyncio.Task] = {}
        self.slot = asyncio.Event()
        self.counts = {"finished": 0, "lost_claim": 0, "dead_lettered": 0, "policy_errors": 0}
        self.commits: Batcher = Batcher(self._flush_commits)
        self.finishes: Batcher = Batcher(self._flush_finishes)
        self.cursor = "0-0"
        self.health: schema.WorkerPolicy | None = None  # this worker's last policy record
        self.stale: str | None = None  # set when the staleness guard trips: the lease fails
        self._refreshing: asyncio.Task | None = None

    # ---------------------------------------------------------------- Redis calls (batched)
    async def _flush_commits(self, items: list[tuple[Entry, schema.Session]]) -> list[int]:
        keys = [self.keys.tasks] + [self.keys.session(e.task_id) for e, _ in items]
        args: list[Any] = [ROLLOUT_GROUP, self.consumer, self.config.rollout.session_ttl_s]
        for e, s in items:
            args += [e.id, e.fence, schema.encode(s)]
        return await self.scripts.commit(keys=keys, args=args)

    async def _flush_finishes(self, items: list[tuple[Entry, schema.Trajectory]]) -> list[int]:
        k = self.keys
        keys = [k.tasks, k.rollouts, k.stats] + [k.session(e.task_id) for e, _ in items]
        args: list[Any] = [ROLLOUT_GROUP, self.consumer]
        for e, t in items:
            args += [e.id, e.fence, e.task_id, schema.encode(t)]
        return await self.scripts.finish(keys=keys, args=args)

    async def _deadletter(self, entry: Entry, reason: str) -> None:
        keys, args = deadletter_call(
            self.keys,
            self.keys.tasks,
            ROLLOUT_GROUP,
            self.consumer,
            [(entry, dead_letter(entry, "rollout", reason), b"")],
            with_session=True,
        )
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

    # ---------------------------------------------------------------- policy health
    async def _load_health(self) -> None:
        """Pick up this worker's record from its previous lease (a worker already behind stays
        behind since then: leases are shorter than ``max_policy_lag_s``), and drop the records
        of workers that went quiet."""
        now = time.time()
        quiet = []
        for field, raw in (await self.r.hgetall(self.keys.policy_health)).items():
            record = health.decode(raw)
            if record is None or not health.is_fresh(record, now):
                quiet.append(field)
            elif record.worker == self.consumer:
                self.health = record
        if quiet:
            await self.r.hdel(self.keys.policy_health, *quiet)

    async def _check_policy(self) -> None:
        """Record the version this worker serves; trip the staleness guard, or take back the
        fault this worker raised once it is recent enough again."""
        cfg = self.config
        latest = await latest_version(self.r, self.keys)
        now = time.time()
        record = health.observe(
            self.health,
            worker=self.consumer,
            backend=self.policy.name,
            version=self.policy.version,
            newest=latest.version if latest is not None else None,
            error=self.policy.reload_error,
            max_staleness=health.max_staleness(cfg),
            heartbeat_s=cfg.streams.heartbeat_s,
            now=now,
        )
        reason = health.stale_reason(record, cfg.rollout.max_policy_lag_s, now)
        if reason is not None:
            record.fault = f"PolicyStale: {reason}"
            await self.r.set(self.keys.fault, record.fault)
            self.stale = reason
            self.slot.set()  # wakes the lease loop if it waits for a free slot
        elif record.behind_since is None and record.fault is not None:
            if await self.r.get(self.keys.fault) == record.fault.encode():
                await self.r.delete(self.keys.fault)
            record.fault = None
        self.health = record
        await self.r.hset(self.keys.policy_health, self.consumer, schema.encode(record))

    async def _policy_heartbeat(self) -> None:
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self.policy.refresh())
        try:
            await self._check_policy()
        except Exception as e:  # Redis trouble: the next heartbeat tries again
            log.warning("policy health check failed", error=repr(e))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.streams.heartbeat_s)
            await self._policy_heartbeat()
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
        """Tasks name their environment; a run may mix several (options: the run's env)."""
        env = self.envs.get(name)
        if env is None:
            env = self.envs[name] = make_env(name)
        return env

    def _start(self, entries: list[Entry]) -> None:
        for e in entries:
            if e.id in self.active:
                continue
            self.held[e.id] = e
            self.active[e.id] = asyncio.create_task(self._episode(e))

    async def _episode(self, entry: Entry) -> None:
        cfg = self.config
        # each asyncio task runs in its own copy of the context: this binding is per episode
        structlog.contextvars.bind_contextvars(
            task_id=entry.task_id, rollout_id=entry.id, policy_version=self.policy.version
        )
        try:
            if entry.fence > cfg.streams.max_deliveries:
                await self._deadletter(
                    entry,
                    f"delivered {entry.fence} times (max {cfg.streams.max_deliveries}): its "
                    "workers died or its policy kept failing",
                )
                return
            try:
                task = schema.check_version(schema.TASK.decode(entry.payload))
            except msgspec.DecodeError as e:
                await self._deadletter(entry, f"undecodable task: {e}")
                return
            session = None
            if entry.session:
                try:
                    session = schema.SESSION.decode(entry.session)
                    session.claims += 1
                    session.resumed_from_turn = len(session.turns)
                except msgspec.DecodeError as e:
                    log.warning("unreadable session, restarting episode", error=str(e))
            try:
                env = self._env(task.env)
                if session is None:
                    session = await anew_session(env, task)
                traj = await run_episode(
                    env,
                    self.policy,
                    task,
                    session,
                    lambda s: self.commits.submit((entry, s)),
                    cfg.rollout,
                    worker=self.consumer,
                )
            except (LostClaim, PolicyError, asyncio.CancelledError):
                raise
            except EnvUnavailable as e:
                # the environment's service failed after its own retries: infrastructure, so
                # the task is dead-lettered with the service's answer, never scored
                await self._deadletter(entry, f"environment unavailable: {e}")
                return
            except Exception as e:  # the environment broke on this task: a failed trajectory
                if session is None:
                    session = schema.Session(task_id=task.task_id, items=list(task.input))
                reason = f"environment error: {type(e).__name__}: {e}"
                traj = finish(task, session, "failed", worker=self.consumer, failure=reason)
            ok = await self.finishes.submit((entry, traj))
            if ok:
                self.counts["finished"] += 1
            else:
                self.counts["lost_claim"] += 1
        except LostClaim:
            self.counts["lost_claim"] += 1
        except PolicyError as e:
            # Infrastructure, not the model's fault: leave the entry pending so that it is
            # retried after claim_idle_ms (and dead-lettered after max_deliveries).
            self.counts["policy_errors"] += 1
            log.error("policy failed; task left for retry", task_id=entry.task_id, error=str(e))
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("rollout worker error; task left for retry", task_id=entry.task_id)
        finally:
            self.held.pop(entry.id, None)
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
        self.config = cfg
        self.envs = {cfg.env: make_env(cfg.env, **cfg.env_options)}
        self.policy = make_policy(
            cfg.policy,
            self.envs[cfg.env],
            redis_url=self.url,
            run=self.run_name,
            env_for=self._env,
        )
        rc = cfg.rollout
        end = started + (self.seconds if self.seconds is not None else rc.lease_seconds)
        heartbeat = None
        try:
            await self._load_health()
            await self.policy.refresh()  # serve the newest version from the first task on
            await self._check_policy()
            if self.stale is None:
                # a lease that fails here queues no successor: the worker's backoff decides
                if self.on_ready is not None:
                    self.on_ready()
                # visible in XINFO CONSUMERS (and `streamrl status`) before its first delivery
                await self.r.xgroup_createconsumer(self.keys.tasks, ROLLOUT_GROUP, self.consumer)
                heartbeat = asyncio.create_task(self._heartbeat_loop())
                await self._consume(end)
        finally:
            for task in (heartbeat, self._refreshing):
                if task is not None:
                    task.cancel()
            await self.policy.close()
            for env in self.envs.values():
                try:
                    await env.aclose()
                except Exception as e:  # a pool that will not close must not fail the lease
                    log.warning("environment close failed", env=env.name, error=repr(e))
        if self.stale is not None:
            log.error("policy too stale; lease fails", reason=self.stale, **self.counts)
            raise health.PolicyStale(self.stale)
        log.info("lease done", run=self.run_name, consumer=self.consumer, **self.counts)
        return self.counts

    async def _consume(self, end: float) -> None:
        """Run episodes until the lease's end, a halt, or the staleness guard trips (then the
        episodes are cancelled at once: their entries stay pending for other workers)."""
        cfg, rc = self.config, self.config.rollout
        self._start(await self._claim(own=True, count=rc.max_concurrent))
        next_stale = next_halt = 0.0
        low_water = max(1, min(rc.read_batch, rc.max_concurrent) // 2)
        while time.monotonic() < end and self.stale is None:
            cap = rc.max_concurrent - len(self.active)
            if cap < low_water and self.active:
                self.slot.clear()
                try:
                    await asyncio.wait_for(self.slot.wait(), timeout=end - time.monotonic())
                except TimeoutError:
                    break
                continue
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
            if self.stale is None:  # else left pending, for other workers to claim
                self._start(parse_read(resp))
        if self.active and self.stale is None:
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
        lease = RolloutLease(r, run, consumer_name(), seconds, on_ready=ready, url=url, shard=shard)
        return await lease.run()
    finally:
        await r.aclose()
