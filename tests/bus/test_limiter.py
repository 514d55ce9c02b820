"""The Redis-held call pool (``streamrl.bus.limiter``) on a real Redis: two pools on the same
keys stand for two worker processes; the limits hold across them, a released slot is free at
once, and a holder that never releases (a killed worker) loses its slot when its lease ends."""

from __future__ import annotations

import threading
import time

import pytest

from streamrl.bus.keys import Keys
from streamrl.bus.limiter import CallPool, PoolTimeout
from tests.support.waiting import wait_for


def _pools(r, n: int = 2, **kw) -> list[CallPool]:
    keys = Keys("limits").judge_pool("endpoint")
    opts = {"max_in_flight": 2, "max_per_second": 0.0, "lease_s": 30.0, **kw}
    return [CallPool(r, keys, **opts) for _ in range(n)]


def test_in_flight_limit_is_shared_and_released_slots_free_at_once(r):
    a, b = _pools(r)
    assert a.try_acquire("1") == 0 and b.try_acquire("2") == 0
    assert a.try_acquire("3") > 0 and b.try_acquire("3") > 0  # 2 of 2 held, by either
    b.release("2")
    assert a.try_acquire("3") == 0
    assert a.in_flight() == 2


def test_a_killed_holders_slot_frees_itself_when_its_lease_ends(r):
    a, b = _pools(r, max_in_flight=1, lease_s=0.3)
    assert a.try_acquire("dead-worker") == 0  # never released
    assert b.try_acquire("live") > 0
    wait_for(lambda: b.try_acquire("live") == 0, "the dead holder's lease to end", 10)
    assert b.in_flight() == 1


def test_rate_limit_counts_starts_across_pools(r):
    a, b = _pools(r, max_in_flight=100, max_per_second=5)
    granted = [p.try_acquire(f"{i}") == 0 for i, p in enumerate([a, b] * 3)]
    assert granted == [True] * 5 + [False]  # the sixth start within a second waits
    wait = a.try_acquire("late")
    assert 0 < wait <= 1001
    # a fractional rate: one start per 2 s
    (c,) = _pools(r, 1, max_in_flight=100, max_per_second=0.5)
    c.starts += "-slow"
    assert c.try_acquire("x") == 0 and 1000 < c.try_acquire("y") <= 2001


def test_slot_waits_for_a_free_one_and_gives_up_with_a_reason(r):
    a, b = _pools(r, max_in_flight=1)
    holding = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with a.slot(wait_s=5):
            holding.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    holding.wait(10)
    with pytest.raises(PoolTimeout, match="no free slot"), b.slot(wait_s=0.2):
        pass
    release.set()
    with b.slot(wait_s=10) as waited:  # free once the holder's body ends
        assert waited >= 0 and b.in_flight() == 1
    t.join()
    assert b.in_flight() == 0


def test_the_verify_role_may_use_the_judge_pool_and_cache(r, redis_server):
    """A verifier worker on its least-privilege ACL user (``streamrl acl``) can take and give
    back a slot and write the judge's cache and figures; the observer only reads them."""
    import redis

    from streamrl.bus.acl import users

    made = {u.role: u for u in users("limits")}
    for role in ("verify", "observer"):
        r.execute_command("ACL", "SETUSER", *made[role].setuser())
    try:

        def as_user(role: str) -> redis.Redis:
            u = made[role]
            return redis.Redis(port=redis_server.port, username=u.name, password=u.password)

        verify = as_user("verify")
        keys = Keys("limits")
        (pool,) = _pools(verify, 1)
        with pool.slot(wait_s=5):
            assert pool.in_flight() == 1
        verify.set(keys.judge_cache("v1", "digest"), b"answer")
        verify.hincrby(keys.judge_stats, "calls", 1)
        observer = as_user("observer")
        assert observer.hget(keys.judge_stats, "calls") == b"1"
        with pytest.raises(redis.exceptions.NoPermissionError):
            observer.set(keys.judge_cache("v1", "digest"), b"forged")
    finally:
        for role in ("verify", "observer"):
            r.acl_deluser(made[role].name)


def test_a_hold_stops_every_pool_on_the_keys_until_it_ends(r):
    """What a 429 with Retry-After does (``CallPool.hold``): no process of the run starts a
    call until the hold has passed; a shorter hold never cuts a longer one short."""
    a, b = _pools(r, max_in_flight=5)
    a.held += "-hold-test"
    b.held = a.held
    assert a.hold(30, "HTTP 429") == 30.0
    assert a.hold(0.05, "HTTP 429 again") > 29  # kept: holds only lengthen
    assert -30_000 <= b.try_acquire("other-worker") < 0  # minus the ms left of the hold
    assert b.in_flight() == 0
    with pytest.raises(PoolTimeout, match="held off by the service"), b.slot(wait_s=0.1):
        pass
    r.delete(a.held)
    before = time.monotonic()
    a.hold(0.3, "HTTP 503")
    with b.slot(wait_s=10):  # sleeps the hold out, then takes a slot
        assert time.monotonic() - before >= 0.3 and a.held_for() == 0 and b.in_flight() == 1
