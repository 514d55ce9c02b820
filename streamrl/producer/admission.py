"""The producer's gate: rollouts may not run ahead of training, nor fill Redis.

Each rule lives in its own module: ``readings`` (what is in flight, the window),
``drop_budget`` (drops settle only as fast as training pays for them; the probe that gets a
run out of debt), ``memory_budget`` (Redis memory, projected), ``holds`` (the reasons and
their messages) and ``state`` (the ``producer_state`` hash). ``LearnerAdmission`` reads them
in a loop until a push may go through.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from streamrl import defaults as d
from streamrl.bus.keys import Keys
from streamrl.bus.shards import run_shards
from streamrl.producer.drop_budget import DropBudget, Probe
from streamrl.producer.holds import DROP_BUDGET, MEMORY_BUDGET, Hold, hold
from streamrl.producer.memory_budget import Memory, MemoryBudget
from streamrl.producer.readings import Gate, Window, read_counters
from streamrl.producer.state import ProducerState


@dataclass
class _Wait:
    """One call's wait: when it began, and when it last counted, told and published."""

    start: float  # time.monotonic()
    since: float  # time.time(), what the hold reports
    counted: float  # time.monotonic() up to which ``waits`` has been charged
    told: float  # time.monotonic() on_wait was last told
    published: bool = False  # the ``waiting`` state has been written


class LearnerAdmission:
    """The producer's gate: blocks ``__call__(n)`` until ``n`` more samples may be pushed.

    **Window** (``readings.Window``): at most ``limit = (max_staleness + 1) x batch``
    samples may be in flight, the learner's published limit or, until it publishes one, the
    ``limit`` given here (``override`` keeps it for good). **Drop budget**
    (``drop_budget``): samples dropped for a fault (stale, no tokens, invalid, a failed
    sample) stay in flight as debt until useful ones pay for them; zero-variance groups
    (solved, or no signal) are the normal cost of GRPO sampling and settle at once.
    **Memory budget** (``memory_budget``): Redis stays under ``redis_memory_mb`` MiB and 80%
    of ``maxmemory``.

    **Why a healthy run cannot deadlock.** (1) Accepted-but-not-yet-applied groups count as
    settled, so with no debt ``in_flight`` is exactly what is still in the pipeline; once it
    has all reached the learner ``in_flight`` is 0, and ``in_flight <= 0`` always admits (even
    a push larger than the window). The learner therefore never waits for a batch that the
    gate keeps from filling. (2) Debt needs a stretch in which more than the whole balance
    is dropped for a fault (zero-variance drops are never charged: a run whose groups are
    all solved keeps its gate open); a run whose fault fraction stays below
    ``max_drop_fraction`` has a balance that drifts up to its cap (per consumed sample
    ``r(1-p) - p > 0`` at fault fraction ``p``), so that takes a sustained failure, not bad
    luck. (3) Even then the gate reopens: every useful sample pays ``r`` of debt, and while
    the gate is closed on debt with nothing left in the pipeline, one probe push gets
    through every ``drop_probe_s``.
    (4) A restarted learner's replayed groups are neither credited nor charged twice, and the
    replay needs no new pushes. (5) The memory budget lets a learner holding a part-filled
    batch with nothing else on its way have its push (Redis may go one push over then).

    **Saying so.** ``on_wait(hold)`` is told every ``tell_every_s`` while held, and the
    state is published in the run's ``producer_state`` hash, which ``streamrl status``
    shows.
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
        self.r = r
        self.keys = Keys(run)
        self.group_size = group_size
        self._window = Window(limit, override)
        self._drops = DropBudget(max_drop_fraction)
        self._probe = Probe(drop_probe_s)
        self._memory_budget = MemoryBudget(r, run, group_size, redis_memory_mb, memory_check_s)
        self._state = ProducerState(r, self.keys.producer_state)
        self.on_wait = on_wait  # told every few seconds while held back
        self.poll_s = poll_s
        self.tell_every_s = tell_every_s
        self.waits: dict[str, float] = {}  # seconds held, by reason
        self._loaded = False
        self._shards: list[Keys] | None = None

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

    # ------------------------------------------------------------------ settings and figures
    @property
    def balance(self) -> float | None:
        """The waste balance in samples (None: not started)."""
        return self._drops.balance

    @property
    def probes(self) -> int:
        """Probe pushes let through while in debt."""
        return self._probe.count

    @property
    def drop_probe_s(self) -> float:
        return self._probe.every_s

    @drop_probe_s.setter
    def drop_probe_s(self, value: float) -> None:
        self._probe.every_s = value

    @property
    def redis_memory_mb(self) -> float:
        return self._memory_budget.redis_memory_mb

    @redis_memory_mb.setter
    def redis_memory_mb(self, value: float) -> None:  # a test lifts the budget mid-run
        self._memory_budget.redis_memory_mb = value
        self._memory_budget.forget()

    # ------------------------------------------------------------------ readings
    def gate(self) -> Gate:
        """Read the counters, charge new drops and credit new useful samples to the balance."""
        if not self._loaded:
            self._loaded = True
            self._state.restore(self._drops)
        c = read_counters(self.r, self.keys, self._run_shards(), self.group_size)
        limit = self._window.limit(c.published_limit)
        return Gate(
            pushed=c.pushed,
            useful=c.useful,
            dropped=c.dropped,
            debt=self._drops.settle(c.useful, c.faults, limit),
            limit=limit,
            learner=c.learner,
            filling=c.filling,
            zero_variance=c.zero_variance,
            verdict=c.verdict,
            held=c.held,
        )

    def in_flight(self) -> tuple[int, int | None]:
        gate = self.gate()
        return gate.in_flight, gate.limit

    def memory(self, gate: Gate, fresh: bool = False) -> Memory | None:
        """Redis memory against the budget (None: no budget), and what the pipeline will
        still add to it; read when ``fresh``, else at most every ``memory_check_s``."""
        return self._memory_budget.read(self._run_shards(), gate.pushed, fresh=fresh)

    def hold(self, n: int, gate: Gate, mem: Memory | None, since: float) -> Hold | None:
        """Why ``n`` more samples may not be pushed now, or None when they may."""
        return hold(n, gate, mem, since, self._drops.max_drop_fraction)

    def _run_shards(self) -> list[Keys]:
        """The run's shards, read from its config once (stored before any push)."""
        if self._shards is None:
            self._shards = run_shards(self.r, self.keys.run)
        return self._shards

    # ------------------------------------------------------------------ the gate
    def __call__(self, n: int) -> None:
        now = time.monotonic()
        wait = _Wait(start=now, since=time.time(), counted=now, told=now)
        fresh = False  # a recent reading will do while the budget is far (MemoryBudget.enough)
        while True:
            gate = self.gate()
            mem = self.memory(gate, fresh=fresh)
            held = self.hold(n, gate, mem, wait.since)
            now = time.monotonic()
            if held is None:
                if self._memory_budget.enough(n, gate.pushed):
                    break
                fresh = True  # near the budget: admit only on a reading taken just now
                continue
            fresh = False
            if self._while_held(held, gate, mem, wait, now):
                break  # a probe
            time.sleep(self.poll_s)
        if wait.published or time.monotonic() - self._state.published_at >= 1.0:
            self._publish("running", None, gate, mem)

    def _while_held(
        self, held: Hold, gate: Gate, mem: Memory | None, wait: _Wait, now: float
    ) -> bool:
        """Trim, count, probe, publish and tell while held; True lets a probe push through."""
        if held.reason == MEMORY_BUDGET:
            self._memory_budget.trim()
        self.waits[held.reason] = self.waits.get(held.reason, 0.0) + (now - wait.counted)
        wait.counted = now
        if held.reason == DROP_BUDGET and gate.pipeline <= 0 and self._probe.due(wait.start, now):
            self._probe.take(now)  # nothing left that could pay the debt: let one push through
            return True
        if now - wait.start >= 1.0 and (
            not wait.published or now - self._state.published_at >= 2.0
        ):
            self._publish("waiting", held, gate, mem)
            wait.published = True
        if self.on_wait is not None and now - wait.told >= self.tell_every_s:
            self.on_wait(held)
            wait.told = now
        return False

    def finish(self) -> None:
        """The producer is done pushing: say so (and keep the balance for the next one)."""
        try:
            gate = self.gate()
        except redis.RedisError:
            return
        self._publish("done", None, gate, self._memory_budget.last)

    def _publish(self, state: str, held: Hold | None, gate: Gate, mem: Memory | None) -> None:
        self._state.publish(state, held, gate, mem, self._probe.count, self._drops)


def admission_batch(learner: dict[str, Any], group_size: int) -> int | None:
    """One learner batch in samples (``batch_groups x group_size``): pushing this much at a
    time lets the gate top the pipeline up as each batch is consumed, instead of waiting for a
    whole window to drain."""
    if not learner:
        return None
    return int(learner.get("batch_groups", 8)) * group_size


def push_samples(learner: dict[str, Any], group_size: int, most: int) -> int:
    """Samples per push: a learner batch (at most ``most``), or one prompt's group when the
    learner is synchronous (``max_staleness = 0``). Its gate holds the batch being trained as
    in flight, so a push only tops that batch up; a larger one could not fit in the window
    until the learner, still waiting for the rest of its batch, had emptied it."""
    if learner and int(learner.get("max_staleness", d.MAX_STALENESS)) == 0:
        return group_size
    return min(most, admission_batch(learner, group_size) or most)


def admission_limit(learner: dict[str, Any], group_size: int) -> int | None:
    """``(max_staleness + 1) x batch samples`` from a run config's ``[learner]`` table."""
    batch = admission_batch(learner, group_size)
    if batch is None:
        return None
    return (int(learner.get("max_staleness", d.MAX_STALENESS)) + 1) * batch
