"""The policy servers of a run, shared by its rollout workers: a bound on the requests in
flight on one server across every worker that uses it (the ``openai`` backend's
``max_inflight_per_server``), and which server a worker uses when there are several.

A per-process limit multiplies with the workers; this one is a sorted set in Redis
(``Keys.server_slots``) that holds one *lease* per request on the server. A request takes a
slot (``scripts.SLOT_ACQUIRE``) before it is sent and gives it back when its answer is in. While
it runs, its process renews the leases it holds every ``lease_s / 3`` (``scripts.SLOT_RENEW``,
one call for all of them), so a request may run far longer than a lease; a process killed
mid-request (SIGKILL) stops renewing, and its slots free themselves ``lease_s`` later, swept by
the next acquire.

Waiting for a slot is not a failure: a request waits as long as it takes (as a request waits on
a slow server), it never raises and never costs its episode a delivery. Within one process the
waiters queue in order (an ``asyncio.Lock`` is FIFO) and only the first one asks Redis, every
``poll_s`` or at once when one of this process's requests gives its slot back. Between
processes they queue in Redis (``Keys.server_slot_queue``), first come first served: a process
that gives a slot back and asks again at once cannot keep it from a process that asked before
(it did, and starved the other for minutes). The price: a freed slot may sit idle until the
waiter it is kept for asks again (under ``poll_s``).

Several servers (``[policy] base_url`` as a list): ``pick_server`` gives a worker the server the
fewest live workers were given (``scripts.SERVER_PICK``, atomic, so workers that start together
spread evenly) and keeps it across the worker's leases; a worker renews its assignment every
``PICK_RENEW_S`` and one that is gone stops counting ``SERVER_PICK_TTL_S`` later.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import structlog

from streamrl.bus import scripts
from streamrl.bus.keys import Keys
from streamrl.defaults import SERVER_PICK_TTL_S

log = structlog.get_logger(__name__)

PICK_RENEW_S = SERVER_PICK_TTL_S / 4


async def pick_server(r: Any, keys: Keys, worker: str, current: str, servers: list[str]) -> str:
    """The server ``worker`` uses (``current``: the one it uses now, '' before its first)."""
    pick = r.register_script(scripts.SERVER_PICK)
    args = [worker, int(SERVER_PICK_TTL_S * 1000), current, *servers]
    url = await pick(keys=list(keys.server_picks), args=args)
    return url.decode() if isinstance(url, bytes) else str(url)


class ServerSlots:
    """The slots of one server, for the requests of one process (one policy client)."""

    def __init__(self, r: Any, key: str, limit: int, *, queue: tuple[str, str],
                 lease_s: float = 30.0, poll_s: float = 0.1, owner: str = "") -> None:  # fmt: skip
        if limit < 1:
            raise ValueError(f"max_inflight_per_server must be at least 1, got {limit}")
        self.r = r
        self.key = key
        self.queue = queue
        # a waiter that has not asked again for this long (killed) leaves the queue: well over
        # its polls, so a busy event loop does not lose its place
        self.wait_ttl_ms = max(2000, int(poll_s * 20_000))
        self.limit = limit
        self.lease_ms = max(100, int(lease_s * 1000))
        self.poll_s = poll_s
        self.owner = owner or uuid.uuid4().hex[:8]  # a prefix of this process's request ids
        self.held: set[str] = set()
        self.waiting = 0  # this process's requests waiting for a slot now
        self.waited_s = 0.0  # total seconds its requests spent waiting
        self.lost = 0  # leases that ended under a live request (the process stalled)
        self._acquire = r.register_script(scripts.SLOT_ACQUIRE)
        self._renew = r.register_script(scripts.SLOT_RENEW)
        self._turn = asyncio.Lock()
        self._freed = asyncio.Event()
        self._renewer: asyncio.Task | None = None

    @property
    def in_flight(self) -> int:
        """This process's requests holding a slot now."""
        return len(self.held)

    async def server_in_flight(self) -> int:
        """Leases held on the server by every process (ended ones until the next sweep)."""
        return int(await self.r.zcard(self.key))

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot for the body of the ``async with``."""
        slot = await self.acquire()
        try:
            yield
        finally:
            await self.release(slot)

    async def acquire(self) -> str:
        slot = f"{self.owner}:{uuid.uuid4().hex[:12]}"
        loop = asyncio.get_running_loop()
        started = loop.time()
        self.waiting += 1
        try:
            async with self._turn:
                try:
                    while True:
                        self._freed.clear()
                        wait_ms = int(
                            await self._acquire(
                                keys=[self.key, *self.queue],
                                args=[slot, self.lease_ms, self.limit, self.wait_ttl_ms],
                            )
                        )
                        if wait_ms == 0:
                            break
                        pause = min(wait_ms / 1000, self.poll_s) * (0.5 + random.random())
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._freed.wait(), timeout=pause)
                except BaseException:  # cancelled: it may hold the slot or a place in the queue
                    with contextlib.suppress(Exception):
                        await self._leave(slot)
                    raise
        finally:
            self.waiting -= 1
            self.waited_s += loop.time() - started
        self.held.add(slot)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_loop())
        return slot

    async def _leave(self, slot: str) -> None:
        await self.r.zrem(self.key, slot)
        for key in self.queue:
            await self.r.zrem(key, slot)

    async def release(self, slot: str) -> None:
        self.held.discard(slot)
        try:
            await self.r.zrem(self.key, slot)
        finally:
            self._freed.set()

    async def _renew_loop(self) -> None:
        while self.held:
            await asyncio.sleep(self.lease_ms / 3000)
            held = list(self.held)
            if not held:
                break
            try:
                lost = await self._renew(keys=[self.key], args=[self.lease_ms, *held])
            except Exception as e:  # Redis trouble: the next round tries again
                log.warning("server slot renewal failed", key=self.key, error=repr(e))
                continue
            lost = [x.decode() if isinstance(x, bytes) else str(x) for x in lost or []]
            lost = [x for x in lost if x in self.held]  # not those released meanwhile
            if lost:
                self.lost += len(lost)
                log.warning(
                    "server slot leases ended under running requests (process stalled?)",
                    key=self.key, lost=len(lost), lease_s=self.lease_ms / 1000,
                )  # fmt: skip

    async def close(self) -> None:
        """Give back every slot still held (a lease that ends mid-request)."""
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(BaseException):
                await self._renewer
        if self.held:
            held, self.held = list(self.held), set()
            with contextlib.suppress(Exception):
                await self.r.zrem(self.key, *held)
