"""Task producers: prompts from an environment's seeded generator or from JSONL rows, each
pushed ``group_size`` times as samples ``<prompt_id>:<k>``.

A producer records its position per source in Redis and pushes each batch with a
compare-and-set on that position (one Lua script), so a restarted producer continues where
the last one stopped and a re-sent batch is never pushed twice.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from streamrl import defaults as d
from streamrl import schema
from streamrl.bus.keys import Keys, shard_keys, shard_of
from streamrl.bus.shards import run_shards, shard_count
from streamrl.bus.streams import Scripts
from streamrl.bus.trim import trim_run
from streamrl.envs import Environment
from streamrl.responses import row_to_prompt

BATCH = 256


@dataclass
class ProduceResult:
    source: str
    prompts: int = 0  # pushed by this call
    samples: int = 0
    skipped: int = 0  # already pushed by an earlier producer of the same source
    rejected: list[str] = field(default_factory=list)  # bad rows, with their reasons
    position: int = 0


def training_seed(seed: int, index: int) -> str:
    """The rng seed of prompt ``index`` of an environment's generator under ``seed``: a pure
    function of both, so a restarted producer pushes the same prompts, and ``streamrl eval``
    can tell which prompts training saw."""
    return f"{seed}:{index}"


def _tasks(prompt_id: str, env: str, group_size: int, inp, data, seed: int) -> list[schema.Task]:
    now = time.time()
    return [
        schema.Task(
            task_id=f"{prompt_id}:{k}",
            prompt_id=prompt_id,
            k=k,
            group_size=group_size,
            env=env,
            input=inp,
            data=data,
            seed=seed,
            created_at=now,
        )
        for k in range(group_size)
    ]


Admission = Callable[[int], None]  # blocks until `n` more samples may enter the pipeline

MiB = 1024 * 1024

# why a producer waits (``Hold.reason``, and ``reason`` in the producer_state hash)
WINDOW_FULL = "window_full"
NO_LEARNER = "no_learner"
DROP_BUDGET = "drop_budget"
MEMORY_BUDGET = "memory_budget"

_LEARNER_FIELDS = (
    "max_in_flight",
    "samples_consumed",
    "groups_applied",
    "waiting_groups",
    "dropped_invalid",
    "updated_at",
)


@dataclass
class Gate:
    """One reading of the pipeline's accounting, in samples."""

    pushed: int  # entries ever added to the tasks stream
    useful: int  # applied by the learner, or accepted into its open batch
    dropped: int  # dropped by the learner (stale, zero-variance, ...) or at group assembly
    debt: int  # dropped samples that training has not paid for yet: they stay in flight
    limit: int | None  # the window, (max_staleness + 1) x batch samples
    learner: bool  # a learner has reported
    filling: bool = False  # the learner holds a part-filled batch: it waits for more groups

    @property
    def pipeline(self) -> int:
        """Samples still on their way to the learner (queued, rolling out, verifying, unread)."""
        return self.pushed - self.useful - self.dropped

    @property
    def in_flight(self) -> int:
        return self.pipeline + self.debt


@dataclass
class Memory:
    """Redis memory against the budget, now and as the samples in flight will leave it."""

    used: int  # bytes, INFO used_memory
    budget: int  # bytes
    source: str  # which setting the budget comes from
    coming: int = 0  # bytes the samples already pushed will add as they are rolled out,
    # scored and grouped (a trajectory and its group entry weigh far more than a task)
    per_sample: int = 0  # bytes one more pushed sample will cost once it is grouped
    in_flight: int = 0  # samples pushed and not yet grouped (or dead-lettered)

    @property
    def over(self) -> bool:
        return self.used >= self.budget

    def fits(self, n: int) -> bool:
        """Whether ``n`` more samples, and everything already in flight, fit in the budget."""
        return self.used + self.coming + n * self.per_sample < self.budget


def memory_info(r: Any) -> dict[str, Any]:
    """``INFO memory`` of the server; on a Redis Cluster, of the master that uses the most
    (the budget holds per node: the first node to fill up stops the run)."""
    from streamrl.connection import is_cluster

    if not is_cluster(r):
        return r.info("memory")
    per_node = r.info("memory", target_nodes=redis.RedisCluster.PRIMARIES)
    if "used_memory" in per_node:  # a single node answered
        return per_node
    return max(per_node.values(), key=lambda i: int(i.get("used_memory", 0)))


def _per_sample(length: int, used: int | None, samples_per_entry: int) -> float:
    """Bytes per sample of a stream, or a prior while it holds too few entries to tell (a
    stream trimmed to its last entry would charge that entry with the whole stream's
    overhead)."""
    if length < 16 or not used:
        return d.ADMISSION_SAMPLE_BYTES_PRIOR
    return used / (length * samples_per_entry)


@dataclass
class Hold:
    """Why the producer waits; what ``on_wait`` is told and ``streamrl status`` shows."""

    reason: str  # WINDOW_FULL | NO_LEARNER | DROP_BUDGET | MEMORY_BUDGET
    message: str
    in_flight: int
    limit: int | None
    since: float  # time.time() when this wait began
    debt: int = 0
    used_mb: float | None = None
    budget_mb: float | None = None


class LearnerAdmission:
    """The producer's gate: rollouts may not run ahead of training, nor fill Redis.

    **Window.** At most ``limit = (max_staleness + 1) x batch`` samples may be in flight:
    pushed but not yet settled. The learner publishes the limit in its progress hash
    (``max_in_flight``); until it does, the ``limit`` given here holds (``override`` keeps it
    for good). Without either there is no window, only the memory budget.

    **Drops settle only as fast as training pays for them.** A sample is settled when the
    learner applied it, or accepted it into the batch it is filling (``groups_applied`` and
    ``waiting_groups``: *useful* samples). Dropped samples (stale, zero-variance, no tokens or
    invalid groups the learner read and discarded, and groups dropped at assembly because a
    sample failed) settle from a *waste balance*: it starts at one window (``limit``), grows
    by ``r = max_drop_fraction / (1 - max_drop_fraction)`` per useful sample (0.9: nine
    dropped samples per applied one), shrinks by one per dropped sample, and is capped at
    ``max(1, r) x limit`` so that a long healthy run does not bank credit that a later
    failure could spend. A negative balance is *debt*: dropped samples that stay in flight::

        in_flight = pushed - useful - dropped + debt;   push n when in_flight + n <= limit

    So a run that applies nothing (workers that never load new policies: every group stale)
    pushes at most about one window plus the balance (at most ``(1 + max(1, r)) x limit``
    samples) and then waits with reason ``drop_budget``, instead of pushing as fast as the
    learner can throw groups away. ``max_drop_fraction = 1`` turns the budget off (every
    drop settles at once, the old rule).

    **Why a healthy run cannot deadlock.** (1) Accepted-but-not-yet-applied groups count as
    settled, so with no debt ``in_flight`` is exactly what is still in the pipeline; once it
    has all reached the learner ``in_flight`` is 0, and ``in_flight <= 0`` always admits (even
    a push larger than the window). The learner therefore never waits for a batch that the
    gate keeps from filling. (2) Debt needs a stretch in which more than the whole balance
    is dropped; a run whose drop fraction stays below ``max_drop_fraction`` has a balance
    that drifts up to its cap (per consumed sample ``r(1-p) - p > 0`` at drop fraction
    ``p``), so that takes a sustained failure, not bad luck. (3) Even then the gate reopens:
    every useful sample pays ``r`` of debt, and while the gate is closed on debt with
    nothing left in the pipeline (so nothing could ever be applied), one probe push gets
    through every ``drop_probe_s``; once the cause is fixed, a probe's groups are applied and
    pay the debt back. (4) A restarted learner republishes the counters of its checkpoint and
    re-reads the entries after it: the balance keeps high-water marks of the useful and
    dropped counts, so replayed groups are neither credited nor charged twice, and the
    replay needs no new pushes.

    **Memory budget.** The budget is ``redis_memory_mb`` MiB or ``0.8 x maxmemory``, the
    smaller. A sample costs little as a task and several times more once its trajectory,
    score and group entry are written, so the gate projects: ``used_memory`` now, plus what
    the samples already in flight will add (per stage, the stream's measured bytes per entry),
    plus the ``n`` samples asked for, each at its measured whole-pipeline cost. It holds
    while that projection reaches the budget, with one exception that keeps a run from
    deadlocking: a learner holding a part-filled batch with nothing else on its way gets its
    push (Redis may go one push over then). It always holds while ``used_memory`` is over.
    Memory is read before every push and at most every ``memory_check_s`` while held. It
    falls as streams are trimmed behind their slowest consumer; while held on memory the
    producer trims too, with no retention window (the replay window gives way to the budget).

    **Saying so.** ``on_wait(hold)`` is told every ``tell_every_s`` while held (``Hold``:
    reason, message, figures, since), and the state (``running``/``waiting``/``done``, reason,
    message, since, figures, and the waste balance, so a restarted producer keeps its debt)
    is published in the run's ``producer_state`` hash, which ``streamrl status`` shows.
    """

    def __init__(
        self,
        r: redis.Redis,
        run: str,
        group_size: int,
        limit: int | None = None,
        poll_s: float = 0.02,
        override: bool = False,
        on_wait: Callable[[Hold], None] | None = None,
        *,
        max_drop_fraction: float = d.ADMISSION_MAX_DROP_FRACTION,
        redis_memory_mb: float = d.ADMISSION_REDIS_MEMORY_MB,
        drop_probe_s: float = d.ADMISSION_DROP_PROBE_S,
        memory_check_s: float = d.ADMISSION_MEMORY_CHECK_S,
        tell_every_s: float = d.ADMISSION_TELL_EVERY_S,
    ):
        if not 0.0 <= max_drop_fraction <= 1.0:
            raise ValueError(f"max_drop_fraction must be in [0, 1], got {max_drop_fraction}")
        self.r = r
        self.keys = Keys(run)
        self.group_size = group_size
        self.limit = limit  # until the learner publishes its own (it may still be loading)
        self.override = override  # keep `limit` even then (experiments that fix the window)
        self.on_wait = on_wait  # told every few seconds while held back
        self.poll_s = poll_s
        self.max_drop_fraction = max_drop_fraction
        self.redis_memory_mb = redis_memory_mb
        self.drop_probe_s = drop_probe_s
        self.memory_check_s = memory_check_s
        self.tell_every_s = tell_every_s
        self.waited_s = 0.0
        self.probes = 0
        self.waits: dict[str, float] = {}  # seconds held, by reason
        # waste balance (samples) and the high-water marks it has been charged up to
        self.balance: float | None = None
        self._seen_useful = 0
        self._seen_dropped = 0
        self._loaded = False
        self._memory: Memory | None = None
        self._memory_at = -float("inf")
        self._trimmed_at = -float("inf")
        self._published_at = -float("inf")
        self._last_probe = -float("inf")
        self._shards: list[Keys] | None = None

    def shards(self) -> list[Keys]:
        """The run's shards, read from its config once (the config is stored before any
        push)."""
        if self._shards is None:
            self._shards = run_shards(self.r, self.keys.run)
        return self._shards

    @classmethod
    def from_config(
        cls,
        r: redis.Redis,
        cfg: Any,
        limit: int | None,
        on_wait: Callable[[Hold], None] | None = None,
        **kw: Any,
    ) -> LearnerAdmission:
        """From a ``RunConfig``: its run, group size and ``[admission]`` table."""
        a = cfg.admission
        return cls(
            r,
            cfg.run,
            cfg.group_size,
            limit=limit,
            on_wait=on_wait,
            max_drop_fraction=a.max_drop_fraction,
            redis_memory_mb=a.redis_memory_mb,
            drop_probe_s=a.drop_probe_s,
            **kw,
        )

    # ------------------------------------------------------------------ accounting
    @property
    def ratio(self) -> float | None:
        """Dropped samples one useful sample pays for; None: no budget (every drop settles)."""
        f = self.max_drop_fraction
        return None if f >= 1.0 else round(f / (1.0 - f), 9)  # 0.9 -> 9, not 9.000000000000002

    def gate(self) -> Gate:
        """Read the counters, charge new drops and credit new useful samples to the balance."""
        if not self._loaded:
            self._load()
        g = self.group_size
        shards = self.shards()
        pipe = self.r.pipeline(transaction=False)
        pipe.hmget(self.keys.learner, list(_LEARNER_FIELDS))
        for keys in shards:
            pipe.xinfo_stream(keys.tasks)
            pipe.hget(keys.stats, "groups_dropped")
        learner, *per_shard = pipe.execute(raise_on_error=False)
        added, assembly_dropped = 0, 0
        for info, shard_dropped in zip(per_shard[::2], per_shard[1::2], strict=True):
            if isinstance(info, redis.ResponseError):  # no tasks stream yet: nothing pushed
                info = {"entries-added": 0}
            elif isinstance(info, Exception):
                raise info
            if isinstance(shard_dropped, Exception):
                raise shard_dropped
            added += int(info["entries-added"])
            assembly_dropped += int(shard_dropped or 0)
        if isinstance(learner, Exception):
            raise learner
        limit_s, consumed, applied, waiting, invalid = (int(float(x or 0)) for x in learner[:5])
        useful = (applied + waiting) * g
        dropped = max(0, consumed + invalid * g - useful) + int(assembly_dropped or 0) * g
        limit = self.limit if self.override or not limit_s else limit_s
        debt = 0
        ratio = self.ratio
        if limit and ratio is not None:
            if self.balance is None:
                self.balance = float(limit)  # one window at start
            credit = max(0, useful - self._seen_useful)
            charge = max(0, dropped - self._seen_dropped)
            cap = max(1.0, ratio) * limit
            self.balance = min(cap, self.balance + ratio * credit - charge)
            debt = math.ceil(-self.balance) if self.balance < 0 else 0
        self._seen_useful = max(self._seen_useful, useful)
        self._seen_dropped = max(self._seen_dropped, dropped)
        return Gate(
            pushed=added,
            useful=useful,
            dropped=dropped,
            debt=debt,
            limit=limit,
            learner=any(x is not None for x in learner),
            filling=waiting > 0,
        )

    def in_flight(self) -> tuple[int, int | None]:
        gate = self.gate()
        return gate.in_flight, gate.limit

    def memory(self, gate: Gate, fresh: bool = False) -> Memory | None:
        """Redis memory against the budget (None: no budget), and what the pipeline will
        still add to it; read when ``fresh``, else at most every ``memory_check_s``."""
        now = time.monotonic()
        if not fresh and now - self._memory_at < self.memory_check_s:
            return self._memory
        self._memory_at = now
        shards = self.shards()
        pipe = self.r.pipeline(transaction=False)
        for k in shards:
            for stream in (k.tasks, k.rollouts, k.scored, k.groups):
                pipe.xlen(stream)
                pipe.memory_usage(stream, samples=5)
            pipe.hmget(k.stats, ["trajectories", "groups_completed", "groups_dropped"])
            pipe.xlen(k.dead)
        replies = pipe.execute()
        # summed over the shards: (length, bytes) per stage, then the stats, then dead letters
        rest: list[Any] = [0] * 8 + [[0, 0, 0], 0]
        for i in range(len(shards)):
            part = replies[10 * i : 10 * i + 10]
            for j in range(8):
                rest[j] += int(part[j] or 0)
            rest[8] = [a + int(b or 0) for a, b in zip(rest[8], part[8], strict=True)]
            rest[9] += int(part[9] or 0)
        info = memory_info(self.r)
        budgets = []
        if self.redis_memory_mb > 0:
            budgets.append((int(self.redis_memory_mb * MiB), "[admission] redis_memory_mb"))
        maxmemory = int(info.get("maxmemory", 0) or 0)
        if maxmemory > 0:
            frac = d.ADMISSION_MAXMEMORY_FRACTION
            budgets.append((int(maxmemory * frac), f"{frac:.0%} of maxmemory"))
        if not budgets:
            self._memory = None
            return None
        budget, source = min(budgets)
        # bytes per sample at each stage, measured on its stream: (length, MEMORY USAGE)
        pairs = [rest[2 * i : 2 * i + 2] for i in range(4)]
        per_task, per_rollout, per_score, per_grouped = (
            _per_sample(length, used, samples)
            for (length, used), samples in zip(pairs, (1, 1, 1, self.group_size), strict=True)
        )
        trajectories, completed, dropped = (int(x or 0) for x in rest[8])
        dead = int(rest[9] or 0)
        grouped = (completed + dropped) * self.group_size
        not_rolled = max(0, gate.pushed - trajectories - dead)
        not_grouped = max(0, gate.pushed - grouped - dead)
        self._memory = Memory(
            used=int(info["used_memory"]),
            budget=budget,
            source=source,
            coming=int(not_rolled * (per_rollout + per_score) + not_grouped * per_grouped),
            per_sample=int(per_task + per_rollout + per_score + per_grouped),
            in_flight=not_grouped,
        )
        return self._memory

    def trim(self) -> None:
        """Held on memory: trim the run's streams behind their slowest consumer, with no
        retention window (verifier leases trim as they end, but with nothing left to verify no
        lease runs, and memory would never fall)."""
        now = time.monotonic()
        if now - self._trimmed_at >= self.memory_check_s:
            self._trimmed_at = now
            trim_run(self.r, self.keys.run, 0)

    def hold(self, n: int, gate: Gate, mem: Memory | None, since: float) -> Hold | None:
        """Why ``n`` more samples may not be pushed now, or None when they may."""
        # Past the budget only for a learner stuck on a part-filled batch with nothing else on
        # its way: holding then would deadlock the run (one push over, at most).
        stuck = gate.filling and mem is not None and mem.in_flight == 0
        if mem is not None and (mem.over or (not mem.fits(n) and not stuck)):
            used, budget = mem.used / MiB, mem.budget / MiB
            return Hold(
                MEMORY_BUDGET,
                f"memory budget: Redis uses {used:.0f} MB of {budget:.0f} MB ({mem.source}), "
                f"and the {mem.in_flight} samples in flight will add {mem.coming / MiB:.0f} "
                "MB; waiting for the pipeline and trimming (or raise [admission] "
                "redis_memory_mb)",
                gate.in_flight, gate.limit, since, gate.debt, round(used, 1), round(budget, 1),
            )  # fmt: skip
        limit = gate.limit
        if limit is None or gate.in_flight + n <= limit or gate.in_flight <= 0:
            return None
        if gate.debt > 0:
            msg = (
                f"drop budget exhausted: {gate.dropped} samples dropped (stale, zero-variance "
                f"or failed) against {gate.useful} trained; {gate.debt} dropped samples wait "
                f"for training to pay for them (max_drop_fraction {self.max_drop_fraction}). "
                "Do the rollout workers load new policies? Do rewards vary within groups? "
                "(Raise [admission] max_drop_fraction if this much waste is expected.)"
            )
            return Hold(DROP_BUDGET, msg, gate.in_flight, limit, since, gate.debt)
        if not gate.learner:
            msg = (
                f"window full: {gate.in_flight} samples pushed (limit {limit}) and no learner "
                "has reported yet; start `streamrl learn`"
            )
            return Hold(NO_LEARNER, msg, gate.in_flight, limit, since)
        msg = (
            f"window full: {gate.in_flight} samples in flight (limit {limit} = "
            "(max_staleness + 1) x batch); waiting for the learner to consume"
        )
        return Hold(WINDOW_FULL, msg, gate.in_flight, limit, since)

    # ------------------------------------------------------------------ the gate
    def __call__(self, n: int) -> None:
        start = last_told = prev = time.monotonic()
        since = time.time()
        told_state = False
        fresh = True  # admit only on a memory reading taken just now
        while True:
            gate = self.gate()
            mem = self.memory(gate, fresh=fresh)
            hold = self.hold(n, gate, mem, since)
            now = time.monotonic()
            if hold is None:
                if fresh or mem is None:
                    break
                fresh = True
                continue
            fresh = False
            if hold.reason == MEMORY_BUDGET:
                self.trim()
            self.waits[hold.reason] = self.waits.get(hold.reason, 0.0) + (now - prev)
            prev = now
            if hold.reason == DROP_BUDGET and gate.pipeline <= 0 and self._probe_due(start, now):
                self.probes += 1  # nothing left that could pay the debt: let one push through
                self._last_probe = now
                break
            if now - start >= 1.0 and (not told_state or now - self._published_at >= 2.0):
                self.publish("waiting", hold, gate, mem)
                told_state = True
            if self.on_wait is not None and now - last_told >= self.tell_every_s:
                self.on_wait(hold)
                last_told = now
            time.sleep(self.poll_s)
        self.waited_s += time.monotonic() - start
        if told_state or time.monotonic() - self._published_at >= 1.0:
            self.publish("running", None, gate, mem)

    def _probe_due(self, start: float, now: float) -> bool:
        if self.drop_probe_s <= 0:
            return False
        return now - max(start, self._last_probe) >= self.drop_probe_s

    def finish(self) -> None:
        """The producer is done pushing: say so (and keep the balance for the next one)."""
        try:
            gate = self.gate()
        except redis.RedisError:
            return
        self.publish("done", None, gate, self._memory)

    # ------------------------------------------------------------------ state in Redis
    def publish(self, state: str, hold: Hold | None, gate: Gate, mem: Memory | None) -> None:
        now = time.time()
        fields: dict[str, str | int | float] = {
            "state": state,
            "reason": hold.reason if hold else "",
            "message": hold.message if hold else "",
            "since": hold.since if hold else now,
            "in_flight": gate.in_flight,
            "limit": gate.limit if gate.limit is not None else "",
            "pushed": gate.pushed,
            "useful": gate.useful,
            "dropped": gate.dropped,
            "debt": gate.debt,
            "probes": self.probes,
            "used_memory_mb": round(mem.used / MiB, 1) if mem else "",
            "memory_budget_mb": round(mem.budget / MiB, 1) if mem else "",
            "memory_coming_mb": round(mem.coming / MiB, 1) if mem else "",
            "pid": os.getpid(),
            "updated_at": now,
            "waste_balance": round(self.balance, 3) if self.balance is not None else "",
            "seen_useful": self._seen_useful,
            "seen_dropped": self._seen_dropped,
        }
        self.r.hset(self.keys.producer_state, mapping=fields)
        self._published_at = time.monotonic()

    def _load(self) -> None:
        """Carry on from the balance a previous producer of this run left."""
        self._loaded = True
        bal, useful, dropped = self.r.hmget(
            self.keys.producer_state, ["waste_balance", "seen_useful", "seen_dropped"]
        )
        if bal not in (None, b"", ""):
            self.balance = float(bal)
            self._seen_useful = int(useful or 0)
            self._seen_dropped = int(dropped or 0)


def admission_batch(learner: dict[str, Any], group_size: int) -> int | None:
    """One learner batch in samples (``batch_groups x group_size``): pushing this much at a
    time lets the gate top the pipeline up as each batch is consumed, instead of waiting for a
    whole window to drain."""
    if not learner:
        return None
    return int(learner.get("batch_groups", 8)) * group_size


def admission_limit(learner: dict[str, Any], group_size: int) -> int | None:
    """``(max_staleness + 1) x batch samples`` from a run config's ``[learner]`` table."""
    if not learner:
        return None
    batch = int(learner.get("batch_groups", 8)) * group_size
    return (int(learner.get("max_staleness", d.MAX_STALENESS)) + 1) * batch


class Producer:
    """Pushes prompts. A sharded run's prompts go round robin over its shards (prompt ``i`` to
    shard ``i mod N``); each shard keeps its own position, advanced with its own
    compare-and-set, so a producer that stopped between two shards' pushes resumes each shard
    where it stands: nothing is pushed twice or skipped."""

    def __init__(
        self,
        r: redis.Redis,
        run: str,
        admission: Admission | None = None,
        batch_samples: int = BATCH,
        shards: int | None = None,
    ):
        self.r = r
        self.keys = Keys(run)
        self.shards = shard_keys(run, shards if shards is not None else shard_count(r, run))
        self.scripts = Scripts(r)
        self.admission = admission
        self.batch_samples = batch_samples

    def position(self, source: str) -> int:
        """Prompts of ``source`` pushed to every shard."""
        return min(self._positions(source))

    def _positions(self, source: str) -> list[int]:
        return [int(self.r.get(k.producer(source)) or 0) for k in self.shards]

    def _push(
        self, source: str, start: int, end: int, batch: list[tuple[int, list[schema.Task]]]
    ) -> tuple[int, set[int]]:
        """Push prompts ``start..end-1`` (``batch``: (index, samples) of those to push).
        Returns the samples pushed and the shards whose push went through (a stale position
        means another producer pushed them first)."""
        if self.admission is not None:
            self.admission(sum(len(tasks) for _, tasks in batch))
        positions = [start] if len(self.shards) == 1 else self._positions(source)
        pushed, shards = 0, set()
        for s, keys in enumerate(self.shards):
            at = positions[s]
            if at >= end:
                continue
            args: list[Any] = [str(at), str(end)]
            for i, tasks in batch:
                if i >= at and shard_of(i, len(self.shards)) == s:
                    for t in tasks:
                        args += [t.task_id, schema.encode(t)]
            n = self.scripts.produce(keys=[keys.tasks, keys.producer(source)], args=args)
            if n >= 0:
                pushed += n
                shards.add(s)
        return pushed, shards

    def from_env(
        self,
        env: Environment,
        count: int,
        group_size: int,
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
        env_spec: str | None = None,
    ) -> ProduceResult:
        """Push prompts ``0..count-1`` of ``env``'s generator under ``seed``. Prompt ``i`` is
        always the same prompt for the same seed, wherever a restarted producer resumes.
        ``env_spec`` is how workers find the environment (a registry name or module:Class)."""
        spec = env_spec or env.name
        source = f"env:{env.name}:seed={seed}"
        res = ProduceResult(source)
        pos = self.position(source)
        res.skipped = min(pos, count)
        while pos < count:
            end = min(count, pos + max(1, self.batch_samples // group_size))
            batch: list[tuple[int, list[schema.Task]]] = []
            for i in range(pos, end):
                prompt = env.generate(random.Random(training_seed(seed, i)), i)
                pid = f"{env.name}-s{seed}-{i:07d}"
                batch.append((i, _tasks(pid, spec, group_size, prompt.input, prompt.data, seed)))
            pushed, _ = self._push(source, pos, end, batch)
            res.prompts += pushed // group_size
            res.samples += pushed
            pos = self.position(source)
            if progress:
                progress(pos)
        res.position = pos
        return res

    def from_jsonl(
        self,
        path: str | Path,
        env: str,
        group_size: int,
        progress: Callable[[int], None] | None = None,
        limit: int | None = None,
    ) -> ProduceResult:
        """Push one prompt per row of the first ``limit`` lines (all by default). A row that
        cannot be read (not UTF-8, not JSON, nested too deeply, no prompt or an empty one, items
        of the wrong shape, an id used by an earlier row) goes to the dead-letter stream with
        its line number and reason; every other row is pushed."""
        path = Path(path)
        source = f"file:{path.resolve()}"
        res = ProduceResult(source)
        pos = self.position(source)
        res.skipped = pos
        rows = list(_read_rows(path))[:limit]
        first_use: dict[str, int] = {}  # prompt id -> line number (0-based) of its first row
        for line_no in range(pos):  # rows pushed by an earlier producer keep their ids
            with contextlib.suppress(ValueError):
                first_use.setdefault(_row_id(rows[line_no], path, line_no), line_no)
        while pos < len(rows):
            end = min(len(rows), pos + max(1, self.batch_samples // group_size))
            batch: list[tuple[int, list[schema.Task]]] = []
            rejects: list[tuple[int, str]] = []
            for line_no in range(pos, end):
                if not rows[line_no].strip():
                    continue
                try:
                    inp, data, pid = row_to_prompt(rows[line_no])
                    pid = pid or _default_id(path, line_no)
                    if pid in first_use:
                        first = first_use[pid] + 1
                        raise ValueError(f"id {pid!r} is already used on line {first}")
                except ValueError as e:
                    rejects.append((line_no, f"{path.name}:{line_no + 1}: {e}"))
                    continue
                first_use[pid] = line_no
                batch.append((line_no, _tasks(pid, data.pop("env", env), group_size, inp, data, 0)))
            pushed, shards = self._push(source, pos, end, batch)
            res.prompts += pushed // group_size
            res.samples += pushed
            # a bad row is dead-lettered by the producer whose push covered its line
            mine = [(n, why) for n, why in rejects if shard_of(n, len(self.shards)) in shards]
            for line_no, reason in mine:
                self._reject(
                    reason, rows[line_no], self.shards[shard_of(line_no, len(self.shards))]
                )
            res.rejected += [reason for _, reason in mine]
            pos = self.position(source)
            if progress:
                progress(pos)
        res.position = pos
        return res

    def _reject(self, reason: str, raw: bytes, keys: Keys) -> None:
        dl = schema.DeadLetter(
            stage="produce", entry_id="", reason=reason, payload=raw, at=time.time()
        )
        self.r.xadd(keys.dead, {"id": "", "p": schema.encode(dl)})
        self.r.hincrby(keys.stats, "dead_letters", 1)


def _read_rows(path: Path) -> Iterator[bytes]:
    """The file's lines as bytes: each one is decoded on its own, so that one bad byte costs
    one row, not the file. A UTF-8 byte order mark at the start is dropped."""
    with open(path, "rb") as f:
        for i, line in enumerate(f):
            if i == 0 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            yield line.rstrip(b"\r\n")


def _default_id(path: Path, line_no: int) -> str:
    return f"{path.stem}-{line_no + 1:07d}"


def _row_id(line: bytes, path: Path, line_no: int) -> str:
    return row_to_prompt(line)[2] or _default_id(path, line_no)
