"""The verifier worker: an rq lease job that scores trajectories from the ``rollouts`` stream.

Start with ``rq worker -w streamrl.workers.LeaseWorker srl-verify`` (or ``streamrl worker
verify``). Each score is appended to the live ``scored`` stream and added to its group in one
Lua script that ignores duplicates; the last sample of a group writes the Group to ``groups``
exactly once. A verifier that raises or times out is retried, then dead-lettered with its
reason and its group dropped: a failure is never a reward of 0.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import msgspec
import redis
import structlog

from streamrl import schema
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
from streamrl.bus.trim import forget_idle_consumers, trim_run
from streamrl.config import RunConfig
from streamrl.defaults import MASKED, SCHEMA_VERSION, VERIFY_GROUP, VERIFY_QUEUE
from streamrl.envs import Environment, SampleMasked
from streamrl.http import RetryPolicy
from streamrl.verifiers.deadline import Deadlines, VerifierTimeout, deadline
from streamrl.verifiers.reward_functions import RewardFunctions
from streamrl.workers import leases
from streamrl.workers.context import consumer_name, control_connection, read_config
from streamrl.workers.envs import EnvTable

log = structlog.get_logger("streamrl.verify")


class VerifyFailure(Exception):
    pass


def verify_one(
    env: Environment,
    traj: schema.Trajectory,
    timeout_s: float,
    retries: int,
    rewards: RewardFunctions | None = None,
    deadlines: Deadlines | None = None,
) -> schema.Score:
    """Score a trajectory, or raise VerifyFailure saying why it could not be scored. Any
    error (a timeout, a crash, a non-finite reward) is worth another attempt, at once; a
    sample the environment masked (``SampleMasked``) is raised as it is, not retried.
    ``rewards``: the run's TRL-style reward functions, which score instead of ``env``;
    ``deadlines``: the batch's timer (one SIGALRM handler for many calls), else one of its own."""
    name, version = rewards.verifier_id if rewards is not None else env.verifier_id
    task = traj.task()
    masked: list[SampleMasked] = []

    def attempt() -> schema.Score | None:
        with deadline(timeout_s) if deadlines is None else deadlines.call(timeout_s):
            if rewards is not None:
                verdict = rewards.score(task, traj)
            else:
                state = env.decode_state(traj.state)
                try:
                    verdict = env.verify(task, traj, state)
                except SampleMasked as e:  # the environment's verdict on its own score: no retry
                    masked.append(e)
                    return None
        reward = float(verdict.reward)
        if reward != reward or reward in (float("inf"), float("-inf")):
            raise ValueError(f"verifier returned a non-finite reward {reward}")
        return schema.Score(
            task_id=traj.task_id,
            prompt_id=traj.prompt_id,
            k=traj.k,
            reward=reward,
            components=verdict.components,
            details=verdict.details,
            info=verdict.info,
            verifier=name,
            verifier_version=version,
            policy_versions=traj.policy_versions,
            scored_at=time.time(),
            env=traj.env,
        )

    def why(e: BaseException) -> str:
        if isinstance(e, VerifierTimeout):
            return str(e)
        return f"verifier {name} raised {type(e).__name__}: {e}"

    def failed(index: int, e: BaseException) -> None:
        log.warning("verifier attempt failed", task_id=traj.task_id, attempt=index, error=why(e))

    def give_up(e: BaseException) -> VerifyFailure:
        return VerifyFailure(f"{why(e)} (after {retries + 1} attempts)")

    score = RetryPolicy(tries=retries + 1, retry_on=(Exception,)).call(attempt, give_up, failed)
    if score is None:
        raise masked[-1]
    return score


class _VerifyLease:
    def __init__(
        self,
        r: redis.Redis,
        run: str,
        consumer: str,
        seconds: float | None = None,
        control: redis.Redis | None = None,
        shard: int | None = None,
    ):
        self.r = r
        self.control = control  # rq's Redis, when the run's data lives elsewhere
        self.keys = Keys(run)  # the run's; this lease's shard once the run's config is read
        self.shard = shard
        self.run_name = run
        self.consumer = consumer
        self.seconds = seconds
        self.scripts = Scripts(r)
        self.table: EnvTable | None = None  # the run's environments, once its config is read
        self.cursor = "0-0"
        self.counts = {"scored": 0, "duplicates": 0, "dead_lettered": 0, "lost_claim": 0}

    def _env(self, name: str) -> tuple[Environment, RewardFunctions | None]:
        """The environment ``name`` stands for and the reward functions that score it (None:
        the environment's own verifier); a name not met yet is looked up in the stored
        mixture first (``workers.envs``)."""
        if self.table is None:
            self.table = EnvTable(self.config, r=self.r)  # r: a judge's pool and cache
        if not self.table.knows(name):
            self.table.learn(self.r.get(self.keys.mix))
        return self.table.env(name), self.table.reward_functions(name)

    def _claim(self, own: bool, count: int) -> list[Entry]:
        args = claim_args(
            VERIFY_GROUP,
            self.consumer,
            self.config.streams.claim_idle_ms,
            count,
            self.cursor,
            own,
            "",
        )
        cursor, entries = parse_claim(self.scripts.claim(keys=[self.keys.rollouts], args=args))
        if not own:
            self.cursor = cursor
        return entries

    def _failure(
        self, e: Entry, reason: str, traj: schema.Trajectory | None, kind: str = ""
    ) -> tuple:
        score = b""
        if traj is not None:
            score = schema.encode(
                schema.Score(
                    task_id=traj.task_id,
                    prompt_id=traj.prompt_id,
                    k=traj.k,
                    reward=None,
                    failure=reason,
                    failure_kind=kind,
                    policy_versions=traj.policy_versions,
                    worker=self.consumer,
                    scored_at=time.time(),
                    env=traj.env,
                )
            )
        return (e, dead_letter(e, "verify", reason, kind), score)

    def _prefetch_judge(self, entries: list[Entry]) -> None:
        """With a judge, ask for the batch's answers side by side (``Judge.prefetch``) before
        scoring it in order, heartbeating the batch meanwhile: one worker then keeps up to
        ``[judge] max_in_flight`` calls out instead of one. In a mixture each environment's
        reward functions hold their own judge (one pool: the run's and endpoint's)."""
        by_judge: dict[int, tuple[Any, list[tuple[schema.Task, schema.Trajectory]]]] = {}
        for e in entries:
            if e.fence > self.config.streams.max_deliveries:
                continue
            try:
                traj = schema.check_version(schema.TRAJECTORY.decode(e.payload))
                rewards = self._env(traj.env)[1]
            except Exception:
                continue  # each sample's own attempt fails with the reason
            if traj.status == "failed" or rewards is None or rewards.judge is None:
                continue
            by_judge.setdefault(id(rewards.judge), (rewards.judge, []))[1].append(
                (traj.task(), traj)
            )

        def beat() -> None:
            args = heartbeat_args(VERIFY_GROUP, self.consumer, entries)
            self.scripts.heartbeat(keys=[self.keys.rollouts], args=args)

        for judge, samples in by_judge.values():
            if len(samples) >= 2:
                judge.prefetch(samples, beat, self.config.streams.heartbeat_s)

    def process(self, entries: list[Entry]) -> None:
        cfg = self.config
        self._prefetch_judge(entries)
        with Deadlines() as deadlines:
            ok, failed = self._verify(entries, deadlines)
        if ok:
            failed += self._score(ok)
        if failed:
            keys, args = deadletter_call(
                self.keys, self.keys.rollouts, VERIFY_GROUP, self.consumer, failed, False,
                cfg.streams.group_done_ttl_s,
            )  # fmt: skip
            res = self.scripts.deadletter(keys=keys, args=args)
            self.counts["dead_lettered"] += sum(res)
            kinds: dict[str, int] = {}
            for (e, blob, _), done in zip(failed, res, strict=True):
                if done:
                    kind = schema.DEAD_LETTER.decode(blob).kind
                    if kind:
                        kinds[kind] = kinds.get(kind, 0) + 1
                    log.warning("dead-lettered trajectory", task_id=e.task_id, kind=kind)
            # counted by kind for `streamrl status` (after the dead letters are written: a
            # worker killed in between undercounts by what it had; the dead stream holds all)
            for kind, n in kinds.items():
                self.r.hincrby(self.keys.stats, kind, n)

    def _verify(
        self, entries: list[Entry], deadlines: Deadlines
    ) -> tuple[list[tuple[Entry, schema.Trajectory, schema.Score]], list[tuple]]:
        """Score each entry (``ok``) or say why it cannot be (``failed``, to dead-letter)."""
        cfg = self.config
        ok: list[tuple[Entry, schema.Trajectory, schema.Score]] = []
        failed: list[tuple] = []
        last_beat = time.monotonic()
        for i, e in enumerate(entries):
            if time.monotonic() - last_beat > cfg.streams.heartbeat_s:
                self.scripts.heartbeat(
                    keys=[self.keys.rollouts],
                    args=heartbeat_args(VERIFY_GROUP, self.consumer, entries[i:]),
                )
                last_beat = time.monotonic()
            if e.fence > cfg.streams.max_deliveries:
                failed.append(self._failure(e, f"delivered {e.fence} times to verifiers", None))
                with contextlib.suppress(Exception):  # what cannot be read holds nothing
                    self._release(schema.TRAJECTORY.decode(e.payload))
                continue
            try:
                traj = schema.check_version(schema.TRAJECTORY.decode(e.payload))
            except msgspec.DecodeError as err:
                failed.append(self._failure(e, f"undecodable trajectory: {err}", None))
                continue
            if traj.status == "failed":
                failed.append(self._failure(e, f"rollout failed: {traj.failure}", traj))
                self._release(traj)
                continue
            try:
                env, rewards = self._env(traj.env)
                score = verify_one(
                    env, traj, cfg.verify.timeout_s, cfg.verify.retries, rewards, deadlines
                )
            except SampleMasked as err:  # an environment failure, by its kind
                failed.append(self._failure(e, str(err), traj, f"{MASKED}{err.kind}"))
                continue
            except Exception as err:  # VerifyFailure; an environment, a function that cannot load
                failed.append(self._failure(e, str(err), traj))
                self._release(traj)
                continue
            score.rollout_id = e.id
            score.worker = self.consumer
            ok.append((e, traj, score))
        return ok, failed

    def _release(self, traj: schema.Trajectory) -> None:
        """A sample dead-lettered here releases what it holds on a server (``nemo-gym``: its
        session is closed). Best effort: a session left open is a leak, never a reward."""
        try:
            env = self._env(traj.env)[0]
            env.release(traj.task(), traj, env.decode_state(traj.state))
        except Exception as err:
            log.warning("could not release a dead-lettered sample", task_id=traj.task_id,
                        error=repr(err))  # fmt: skip

    def _score(self, ok: list[tuple[Entry, schema.Trajectory, schema.Score]]) -> list[tuple]:
        """Add scores to their groups; returns the failures for samples the script refused."""
        k = self.keys
        keys = [k.rollouts, k.scored, k.groups, k.stats]
        ttl = self.config.streams.group_done_ttl_s
        args: list[Any] = [VERIFY_GROUP, self.consumer, SCHEMA_VERSION, ttl]
        for e, traj, score in ok:
            keys.append(k.group(traj.prompt_id))
            sample = schema.Sample(score=score, trajectory=traj)
            args += [
                e.id,
                e.fence,
                traj.task_id,
                traj.prompt_id,
                traj.k,
                traj.group_size,
                repr(score.reward),
                schema.encode(score),
                schema.encode(sample),
            ]
        res = self.scripts.score(keys=keys, args=args)
        self.counts["scored"] += res.count(1)
        self.counts["duplicates"] += res.count(2)
        self.counts["lost_claim"] += res.count(0)
        return [
            self._failure(
                e,
                f"impossible sample: k={traj.k}, group_size={traj.group_size}, reward="
                f"{score.reward!r} does not fit group {traj.prompt_id} (its first sample set "
                "its size, or the values are out of range)",
                traj,
            )
            for (e, traj, score), r in zip(ok, res, strict=True)
            if r == 3
        ]

    def _wait_config(self, until: float) -> RunConfig | None:
        while time.monotonic() < until:
            cfg = read_config(self.r.get(self.keys.config))
            if cfg is not None:
                return cfg
            time.sleep(0.5)
        return None

    def run(self) -> dict[str, Any]:
        started = time.monotonic()
        cfg = self._wait_config(started + (self.seconds or 30.0))
        if cfg is None:
            return self.counts
        keys = keys_of_shard(self.run_name, self.shard, cfg.streams.shards)
        if keys is None:
            log.info(NO_SUCH_SHARD, shard=self.shard, shards=cfg.streams.shards)
            return self.counts
        self.keys, self.config = keys, cfg
        leases.top_up_if_work(
            self.r,
            VERIFY_QUEUE,
            self.run_name,
            at_most_every_s=1.0,
            control=self.control,
            shard=self.keys.shard,
        )
        vc = cfg.verify
        end = started + (self.seconds if self.seconds is not None else vc.lease_seconds)
        self.r.xgroup_createconsumer(self.keys.rollouts, VERIFY_GROUP, self.consumer)
        self.process(self._claim(own=True, count=vc.batch))
        next_stale = next_halt = 0.0
        idle = leases.idle_yield(self.control or self.r, VERIFY_QUEUE, self.run_name, keys.shard)
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_halt:
                next_halt = now + 0.5
                if self.r.exists(self.keys.halt):
                    break
            claimed: list = []
            if now >= next_stale:
                next_stale = now + max(0.2, cfg.streams.claim_idle_ms / 2000)
                claimed = self._claim(own=False, count=vc.batch)
                self.process(claimed)
            block = int(min(cfg.streams.block_ms, max(1.0, (end - now) * 1000)))
            resp = self.r.xreadgroup(
                VERIFY_GROUP, self.consumer, {self.keys.rollouts: ">"}, count=vc.batch, block=block
            )
            read = parse_read(resp)
            self.process(read)
            if read or claimed:
                idle.busy()
            elif idle.should_end():
                log.info("lease ends early: nothing to do here, another lease waits")
                break
        # each verifier lease also trims the run's streams behind their slowest consumer group
        trim_run(self.r, self.run_name, cfg.streams.retention_ms)
        forget_idle_consumers(self.r, self.run_name)
        log.info("lease done", run=self.run_name, consumer=self.consumer, **self.counts)
        return self.counts


def lease(run: str, seconds: float | None = None, shard: int | None = None) -> dict[str, Any]:
    """The rq job: verify (one shard of a sharded run) for one lease, then hand the worker
    back to rq."""
    return leases.run_lease(
        run,
        VERIFY_QUEUE,
        "verify",
        lambda conn: _VerifyLease(
            conn, run, consumer_name(), seconds, control=control_connection(), shard=shard
        ).run(),
        shard=shard,
    )
