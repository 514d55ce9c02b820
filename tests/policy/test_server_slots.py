"""The slots of one policy server in Redis (``streamrl.policy.server_slots``), on the session's
real redis-server: the bound holds across clients, waiting is not a failure, and a holder that
stops renewing (killed) loses its slots when their leases end; workers spread over several
servers."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio

from streamrl.bus import scripts
from streamrl.bus.keys import Keys
from streamrl.policy.server_slots import ServerSlots


def test_bound_holds_across_clients_and_a_dead_holders_slots_come_back(redis_url, run_name):
    key = Keys(run_name).server_slots("s1")

    async def main():
        conns = [redis.asyncio.Redis.from_url(redis_url) for _ in range(3)]
        a, b = (ServerSlots(c, key, 2, lease_s=1.5, poll_s=0.02) for c in conns[:2])
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
        dead = ServerSlots(conns[2], key, 2, lease_s=1.5, owner="dead")
        for _ in range(2):
            await dead._acquire(keys=[key], args=[f"dead:{_}", dead.lease_ms, 2])
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
