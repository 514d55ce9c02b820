"""The memory budget: rollouts may not fill Redis.

The budget is ``redis_memory_mb`` MiB or ``0.8 x maxmemory``, the smaller. A sample costs
little as a task and several times more once its trajectory, score and group entry are
written, so the gate projects: ``used_memory`` now, plus what the samples already in flight
will add (per stage, the stream's measured bytes per entry), plus the ``n`` samples asked
for, each at its measured whole-pipeline cost. Memory is read at most every ``check_s``, and
again before a push unless the latest reading, with every sample pushed since and the push,
stays under ``ADMISSION_MEMORY_FAR`` (half) of the budget: a reading is an ``INFO`` and ten
stream commands, and a run far from its budget made two a push. Memory falls as streams are
trimmed behind their slowest consumer; while held on memory the producer trims too, with no
retention window (the replay window gives way to the budget).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import redis

from streamrl import defaults as d
from streamrl.bus.keys import Keys
from streamrl.bus.trim import trim_run
from streamrl.connection import is_cluster
from streamrl.producer.readings import Memory, MiB


@dataclass
class _Stages:
    """Summed over a run's shards: (length, MEMORY USAGE) of tasks, rollouts, scored and
    groups, the stats counters that say how far samples got, and the dead letters."""

    sizes: list[int]  # [tasks length, tasks bytes, rollouts length, ..., groups bytes]
    trajectories: int = 0
    completed: int = 0  # groups
    dropped: int = 0  # groups
    dead: int = 0


class MemoryBudget:
    """Reads Redis memory against the budget, at most every ``check_s`` unless asked for a
    fresh reading, and trims the run while held."""

    def __init__(
        self, r: redis.Redis, run: str, group_size: int, redis_memory_mb: float, check_s: float
    ):
        self.r = r
        self.run = run
        self.group_size = group_size
        self.redis_memory_mb = redis_memory_mb
        self.check_s = check_s
        self.last: Memory | None = None  # the latest reading
        self.current = False  # ``last`` was read by the latest ``read`` call
        self._read_at = -math.inf
        self._pushed_at_read = 0  # ``pushed`` when ``last`` was read
        self._trimmed_at = -math.inf

    def read(self, shards: list[Keys], pushed: int, fresh: bool = False) -> Memory | None:
        """Redis memory against the budget (None: no budget), and what the ``pushed`` samples
        will still add to it; read when ``fresh``, else at most every ``check_s``."""
        now = time.monotonic()
        if not fresh and now - self._read_at < self.check_s:
            self.current = False
            return self.last
        self._read_at, self._pushed_at_read, self.current = now, pushed, True
        info = _memory_info(self.r)
        budget = _budget(info, self.redis_memory_mb)
        # the stages (ten commands a shard) only for a budget to project against
        self.last = (
            None
            if budget is None
            else self._project(info, budget, _read_stages(self.r, shards), pushed)
        )
        return self.last

    def enough(self, n: int, pushed: int) -> bool:
        """Whether a push of ``n`` samples may go on the latest reading (no budget counts):
        it was just taken, or it leaves the budget far from reach (``ADMISSION_MEMORY_FAR``)
        with the samples pushed since (``pushed`` now) and these ``n``."""
        m = self.last
        if self.current or m is None:
            return True
        since = max(0, pushed - self._pushed_at_read)
        return m.used + m.coming + (since + n) * m.per_sample < m.budget * d.ADMISSION_MEMORY_FAR

    def forget(self) -> None:
        """The next ``read`` reads (the budget changed)."""
        self.last, self.current, self._read_at = None, False, -math.inf

    def _project(
        self, info: dict[str, Any], budget: tuple[int, str], stages: _Stages, pushed: int
    ) -> Memory:
        # bytes per sample at each stage, measured on its stream: (length, MEMORY USAGE)
        s = stages.sizes
        per_task, per_rollout, per_score, per_grouped = (
            _per_sample(s[2 * i], s[2 * i + 1], samples)
            for i, samples in enumerate((1, 1, 1, self.group_size))
        )
        grouped = (stages.completed + stages.dropped) * self.group_size
        not_rolled = max(0, pushed - stages.trajectories - stages.dead)
        not_grouped = max(0, pushed - grouped - stages.dead)
        return Memory(
            used=int(info["used_memory"]),
            budget=budget[0],
            source=budget[1],
            coming=int(not_rolled * (per_rollout + per_score) + not_grouped * per_grouped),
            per_sample=int(per_task + per_rollout + per_score + per_grouped),
            in_flight=not_grouped,
        )

    def trim(self) -> None:
        """Held on memory: trim the run's streams behind their slowest consumer, with no
        retention window (verifier leases trim as they end, but with nothing left to verify no
        lease runs, and memory would never fall)."""
        now = time.monotonic()
        if now - self._trimmed_at >= self.check_s:
            self._trimmed_at = now
            trim_run(self.r, self.run, 0)


def _read_stages(r: redis.Redis, shards: list[Keys]) -> _Stages:
    pipe = r.pipeline(transaction=False)
    for k in shards:
        for stream in (k.tasks, k.rollouts, k.scored, k.groups):
            pipe.xlen(stream)
            pipe.memory_usage(stream, samples=5)
        pipe.hmget(k.stats, ["trajectories", "groups_completed", "groups_dropped"])
        pipe.xlen(k.dead)
    replies = pipe.execute()
    out = _Stages(sizes=[0] * 8)
    for i in range(len(shards)):
        part = replies[10 * i : 10 * i + 10]
        for j in range(8):
            out.sizes[j] += int(part[j] or 0)
        trajectories, completed, dropped = (int(x or 0) for x in part[8])
        out.trajectories += trajectories
        out.completed += completed
        out.dropped += dropped
        out.dead += int(part[9] or 0)
    return out


def _budget(info: dict[str, Any], redis_memory_mb: float) -> tuple[int, str] | None:
    """(bytes, the setting it comes from): the smaller of ``redis_memory_mb`` and the share
    of ``maxmemory``; None when neither is set."""
    budgets = []
    if redis_memory_mb > 0:
        budgets.append((int(redis_memory_mb * MiB), "[admission] redis_memory_mb"))
    maxmemory = int(info.get("maxmemory", 0) or 0)
    if maxmemory > 0:
        frac = d.ADMISSION_MAXMEMORY_FRACTION
        budgets.append((int(maxmemory * frac), f"{frac:.0%} of maxmemory"))
    return min(budgets) if budgets else None


def _memory_info(r: Any) -> dict[str, Any]:
    """``INFO memory`` of the server; on a Redis Cluster, of the master that uses the most
    (the budget holds per node: the first node to fill up stops the run)."""
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
