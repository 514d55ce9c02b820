"""The slots of one policy server in Redis (``streamrl.policy.server_slots``), on the session's
real redis-server: the bound holds across clients, waiting is not a failure, and a holder that
stops renewing (killed) loses its slots when their leases end; waiting processes are served
in the order they asked; workers spread over several servers."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio

from streamrl.bus import scripts
from streamrl.bus.keys import Keys
from streamrl.policy.server_slots import ServerSlots


def test_bound_holds_across_clients_and_a_dead_holders_slots_come_back(redis_url, run_name):
    key, queue = Keys(run_name).server_slots("s1"), Keys(run_name).server_slot_queue("s1")

    async def main():
        conns = [redis.asyncio.Redis.from_url(redis_url) for _ in range(3)]
        a, b = (ServerSlots(c, key, 2, queue=queue, lease_s=1.5, poll_s=0.02) for c in conns[:2])
        peak, now = [0], [0]

        async def request(slots: ServerSlots, hold: float = 0.05) -> None:
            async with slots.slot():
                now[0] += 1
                peak[0] = max(peak[0], now[0], await conns[2].zcard(key))
                await asyncio.sleep(hold)
                now[0] -= 1

        # 2 "processes" x 8 concurrent requests, bound 2; longer than a lease: renewals keep them
        await asyncio.gather(*(request(s) for s in (a, b) for _ in range(8)))
        long = asyncio.create_task(request(a, hold=3.5))
        await asyncio.sleep(3.2)  # > 2 leases: the renewals keep the slot
        assert await conns[2].zcard(key) == 1
        await long
        assert peak[0] == 2, peak
        assert a.waited_s > 0 and a.waiting == b.waiting == 0 and a.lost == b.lost == 0
        # a holder that is killed: it took both slots and never renews or releases them
        dead = ServerSlots(conns[2], key, 2, queue=queue, lease_s=1.5, owner="dead")
        for _ in range(2):
            args = [f"dead:{_}", dead.lease_ms, 2, dead.wait_ttl_ms]
            await dead._acquire(keys=[key, *queue], args=args)
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(request(b), timeout=5)
        waited = asyncio.get_running_loop().time() - t0
        assert 1.0 < waited < 5.0, waited  # its leases ended, then the next acquire swept them
        left = await conns[2].zrange(key, 0, -1)  # the dead holder's other lease, until swept
        assert all(m.startswith(b"dead:") for m in left), left
        for s in (a, b):
            await s.close()
        for c in conns:
            await c.aclose()

    asyncio.run(main())


def test_waiters_are_served_in_the_order_they_asked(redis_url, run_name):
    """``SLOT_ACQUIRE`` step by step: a freed slot is kept for the request that waited longest,
    not taken by one that asks after it (a process whose requests give a slot back and ask again
    at once kept every slot before the queue, and another process starved), and a waiter that
    stopped asking (killed) loses its place. Then two processes: the one that asks once is
    served while the other keeps both slots busy."""
    keys = Keys(run_name)
    key, queue = keys.server_slots("s1"), keys.server_slot_queue("s1")

    async def main():
        conns = [redis.asyncio.Redis.from_url(redis_url) for _ in range(3)]
        script = conns[2].register_script(scripts.SLOT_ACQUIRE)

        async def ask(request: str, limit: int = 2, wait_ttl_ms: int = 60_000) -> int:
            return int(await script(keys=[key, *queue], args=[request, 60_000, limit, wait_ttl_ms]))

        assert [await ask("a1"), await ask("a2")] == [0, 0]
        assert await ask("b1") > 0  # full: b1 waits
        await conns[2].zrem(key, "a1")  # a1 gives its slot back ...
        assert await ask("a3") > 0  # ... and a3, asking at once, does not take it from b1
        assert await ask("b1") == 0
        assert await conns[2].zrange(queue[0], 0, -1) == [b"a3"]
        await conns[2].zrem(key, "a2", "b1")  # two free: a3 first, then anyone
        assert [await ask("c1"), await ask("a3")] == [0, 0]
        assert await conns[2].zcard(queue[0]) == await conns[2].zcard(queue[1]) == 0
        # a waiter that stopped asking (killed) leaves the queue after wait_ttl_ms
        assert await ask("ghost", wait_ttl_ms=300) > 0
        await conns[2].zrem(key, "c1", "a3")
        await conns[2].zadd(key, {"holder": 10**15})  # one of two slots held
        assert await ask("d1", limit=1) > 0  # the free slot is the ghost's while its place lasts
        deadline = time.monotonic() + 10
        await conns[2].zrem(key, "holder")
        while await ask("d1", limit=1) != 0:
            assert time.monotonic() < deadline, await conns[2].zrange(queue[0], 0, -1)
            await asyncio.sleep(0.02)
        assert await conns[2].zrange(queue[0], 0, -1) == []
        await conns[2].delete(key)

        # two processes: ``a`` keeps both slots busy, asking again the moment it gives one back
        a = ServerSlots(conns[0], key, 2, queue=queue)
        b = ServerSlots(conns[1], key, 2, queue=queue)
        assert a.wait_ttl_ms == 2000  # twenty polls
        stop = asyncio.Event()

        async def busy() -> None:
            while not stop.is_set():
                async with a.slot():
                    await asyncio.sleep(0.02)

        loops = [asyncio.create_task(busy()) for _ in range(4)]
        while a.in_flight < 2:
            await asyncio.sleep(0.001)
        async with b.slot():
            assert b.in_flight == 1
        stop.set()
        await asyncio.gather(*loops)
        for s in (a, b):
            await s.close()
        for conn in conns:
            await conn.aclose()

    asyncio.run(main())


def test_workers_spread_over_servers_and_keep_theirs(r, run_name):
    """``SERVER_PICK``: the least used server of live workers, sticky per worker, and a worker
    that stopped renewing (gone) stops counting when its assignment ends."""
    pick = r.register_script(scripts.SERVER_PICK)
    keys = list(Keys(run_name).server_picks)
    urls = ["http://a", "http://b", "http://c"]

    def given(worker: str, ttl_ms: int = 60_000, current: str = "") -> str:
        return pick(keys=keys, args=[worker, ttl_ms, current, *urls]).decode()

    first = [given(f"w{i}") for i in range(6)]
    assert sorted(first) == sorted(urls * 2), first
    assert [given(f"w{i}") for i in range(6)] == first  # each keeps its server
    assert given("brief", ttl_ms=50) == "http://a"  # a tie: the first of them
    time.sleep(0.2)  # its assignment ended: "a" has 2 live workers again, like the others
    assert given("w6") == "http://a"
    # a worker whose assignment ended mid-lease keeps the server it talks to
    r.hdel(keys[0], "w0")
    r.zrem(keys[1], "w0")
    assert given("w0", current=first[0]) == first[0]
