"""A bounded pool of calls to one outside service, held in Redis so that every worker process of
a run shares it: at most ``max_in_flight`` calls at once and ``max_per_second`` started, however
many verifier workers there are. A per-process limit would multiply with the workers; this one
does not.

Each call takes a *lease* (``scripts.POOL_ACQUIRE``) and gives it back when it ends; a process
killed mid-call never gives it back, and its lease ends by itself ``lease_s`` later. A lease
must therefore outlast the longest call: the judge takes its HTTP timeout plus a margin.

A service that asks callers to back off (HTTP 429 or 503 with ``Retry-After``) is held off as a
whole: ``hold`` stops every call of every process from starting until the time it named has
passed (``scripts.POOL_HOLD``), not only the call that was told.
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
        keys: tuple[str, str, str],
        max_in_flight: int,
        max_per_second: float,
        lease_s: float,
    ) -> None:
        self.r = r
        self.busy, self.starts, self.held = keys
        self.max_in_flight = max_in_flight
        self.max_per_second = max_per_second
        self.lease_ms = int(lease_s * 1000)
        self._acquire = r.register_script(scripts.POOL_ACQUIRE)
        self._hold = r.register_script(scripts.POOL_HOLD)

    def try_acquire(self, call_id: str) -> int:
        """0 when ``call_id`` now holds a slot; below 0, minus the ms left of a hold (the
        service asked for a back-off); else about how many ms until asking again."""
        args = [call_id, self.lease_ms, self.max_in_flight, self.max_per_second]
        return int(self._acquire(keys=[self.busy, self.starts, self.held], args=args))

    def hold(self, seconds: float, why: str) -> float:
        """Start no call for ``seconds`` (a hold already ending later is kept); the seconds
        the pool is now held for."""
        ms = max(1, int(seconds * 1000))
        return int(self._hold(keys=[self.held], args=[ms, why[:200]])) / 1000

    def held_for(self) -> float:
        """Seconds left of the service's hold (0: none)."""
        return max(0, int(self.r.pttl(self.held))) / 1000

    def release(self, call_id: str) -> None:
        self.r.zrem(self.busy, call_id)

    def in_flight(self) -> int:
        """Leases held now (expired ones included until the next acquire sweeps them)."""
        return int(self.r.zcard(self.busy))

    @contextmanager
    def slot(self, wait_s: float) -> Iterator[float]:
        """Hold one slot for the body of the ``with``; yields the seconds spent waiting for
        it (a hold of the service's included). Raises ``PoolTimeout`` after ``wait_s`` without
        one."""
        call_id = uuid.uuid4().hex
        start = time.monotonic()
        while (wait_ms := self.try_acquire(call_id)) != 0:
            waited = time.monotonic() - start
            if waited >= wait_s:
                held = f"; held off by the service for {-wait_ms / 1000:.1f} s more" * (wait_ms < 0)
                raise PoolTimeout(
                    f"no free slot in {waited:.1f} s (max_in_flight={self.max_in_flight}, "
                    f"max_per_second={self.max_per_second:g}, shared by the run's workers{held})"
                )
            if wait_ms < 0:  # held: sleep it out (the hold's end is known), spread a little
                pause = -wait_ms / 1000 * (1 + random.random() / 4)
                time.sleep(min(pause, max(wait_s - waited, 0.001)))
                continue
            # poll: a slot frees whenever a holder ends, before the lease's end Redis names
            pause = min(wait_ms / 1000, JUDGE_POLL_S) * (0.5 + random.random())
            time.sleep(max(pause, 0.001))
        try:
            yield time.monotonic() - start
        finally:
            self.release(call_id)
