"""The run's ``producer_state`` hash, which ``streamrl status`` and ``streamrl metrics`` show:
``running``/``waiting``/``done``, while waiting the reason, message and since, the gate's
figures, and the waste balance, so that a restarted producer keeps its debt."""

from __future__ import annotations

import math
import os
import time

import redis

from streamrl.producer.drop_budget import DropBudget
from streamrl.producer.holds import Hold
from streamrl.producer.readings import Gate, Memory, MiB


class ProducerState:
    """Writes the hash, and reads back what a previous producer of the run left."""

    def __init__(self, r: redis.Redis, key: str):
        self.r = r
        self.key = key
        self.published_at = -math.inf  # time.monotonic() of the last write

    def publish(
        self,
        state: str,
        hold: Hold | None,
        gate: Gate,
        mem: Memory | None,
        probes: int,
        drops: DropBudget,
    ) -> None:
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
            "dropped_zero_variance": gate.zero_variance,  # of dropped; never charged as debt
            "debt": gate.debt,
            "probes": probes,
            "used_memory_mb": round(mem.used / MiB, 1) if mem else "",
            "memory_budget_mb": round(mem.budget / MiB, 1) if mem else "",
            "memory_coming_mb": round(mem.coming / MiB, 1) if mem else "",
            "pid": os.getpid(),
            "updated_at": now,
            **drops.fields(),
        }
        self.r.hset(self.key, mapping=fields)
        self.published_at = time.monotonic()

    def restore(self, drops: DropBudget) -> None:
        """Carry on from the balance a previous producer of this run left."""
        drops.restore(*self.r.hmget(self.key, ["waste_balance", "seen_useful", "seen_dropped"]))
