"""A bounded pool of calls to one outside service, held in Redis so that every worker process of
a run shares it: at most ``max_in_flight`` calls at once and ``max_per_second`` started, however
many verifier workers there are. A per-process limit would multiply with the workers; this one
does not.

Each call takes a *lease* (``scripts.POOL_ACQUIRE``) and gives it back when it ends; a process
killed mid-call never gives it back, and its lease ends by itself ``lease_s`` later. A lease
must therefore outlast the longest call: the judge takes its HTTP timeout plus a margin.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from streamrl.bus import scripts
from streamrl.defaults import JUDGE_POLL_S


class PoolTimeout(Exception):
    """No slot of the pool came free in time: the service is saturated (infrastructure)."""


class CallPool:
    def __init__(
        self,
        r: redis.Redis,
        keys: tuple[str, str],
        max_in_flight: int,
        max_per_second: float,
        lease_s: float,
    ) -> None:
        self.r = r
        self.busy, self.starts = keys
        self.max_in_flight = max_in_flight
        self.max_per_second = max_per_second
        self.lease_ms = int(lease_s * 1000)
        self._acquire = r.register_script(scripts.POOL_ACQUIRE)

    def try_acquire(self, call_id: str) -> int:
        """0 when ``call_id`` now holds a slot, else about how many ms until asking again."""
        args = [call_id, self.lease_ms, self.max_in_flight, self.max_per_second]
        return int(self._acquire(keys=[self.busy, self.starts], args=args))

    def release(self, call_id: str) -> None:
        self.r.zrem(self.busy, call_id)

    def in_flight(self) -> int:
        """Leases held now (expired ones included until the next acquire sweeps them)."""
        return int(self.r.zcard(self.busy))

    @contextmanager
    def slot(self, wait_s: float) -> Iterator[float]:
        """Hold one slot for the body of the ``with``; yields the seconds spent waiting for
        it. Raises ``PoolTimeout`` after ``wait_s`` without one."""
        call_id = uuid.uuid4().hex
        start = time.monotonic()
        while (wait_ms := self.try_acquire(call_id)) > 0:
            waited = time.monotonic() - start
            if waited >= wait_s:
                raise PoolTimeout(
                    f"no free slot in {waited:.1f} s (max_in_flight={self.max_in_flight}, "
                    f"max_per_second={self.max_per_second:g}, shared by the run's workers)"
                )
            # poll: a slot frees whenever a holder ends, before the lease's end Redis names
            pause = min(wait_ms / 1000, JUDGE_POLL_S) * (0.5 + random.random())
            time.sleep(max(pause, 0.001))
        try:
            yield time.monotonic() - start
        finally:
            self.release(call_id)
