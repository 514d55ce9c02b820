"""A lease with nothing to do hands its worker to a lease of another run or shard that is
waiting for one (`leases.IdleYield`, `leases.others_waiting`), and only then. The pipeline
case (one worker per role, three shards) is in test_worker_start.py."""

from __future__ import annotations

import redis

from streamrl.defaults import ROLLOUT_QUEUE
from streamrl.workers import leases


def test_others_waiting_are_leases_of_another_run_or_shard(r):
    assert not leases.others_waiting(r, ROLLOUT_QUEUE, "a", 0)  # nothing queued
    leases.top_up(r, ROLLOUT_QUEUE, "a", shard=0, waiting=2)
    assert not leases.others_waiting(r, ROLLOUT_QUEUE, "a", 0)  # only this shard's own
    assert leases.others_waiting(r, ROLLOUT_QUEUE, "a", 1)  # another shard of the run
    assert leases.others_waiting(r, ROLLOUT_QUEUE, "a", None)  # the run unsharded
    assert leases.others_waiting(r, ROLLOUT_QUEUE, "b", 0)  # another run
    assert not leases.others_waiting(r, "srl-verify", "b", 0)  # another queue's are not


def test_idle_yield_asks_after_the_idle_time_and_at_most_once_per_idle_time():
    asked: list[float] = []
    answer = [False]

    def others() -> bool:
        asked.append(1.0)
        return answer[0]

    idle = leases.IdleYield(others, idle_s=1.0)
    assert not idle.should_end(now=10.0)  # idle from now on
    assert not idle.should_end(now=10.9) and asked == []  # not idle long enough to ask
    assert not idle.should_end(now=11.0) and len(asked) == 1  # asked: nobody waits
    assert not idle.should_end(now=11.5) and len(asked) == 1  # not again so soon
    answer[0] = True
    assert idle.should_end(now=12.0) and len(asked) == 2
    idle.busy()  # work came: the idle time starts again
    assert not idle.should_end(now=12.5) and not idle.should_end(now=13.4)
    assert idle.should_end(now=13.5)


def test_an_unreachable_queue_keeps_the_lease():
    def others() -> bool:
        raise redis.ConnectionError("rq's Redis is down")

    idle = leases.IdleYield(others, idle_s=0.0)
    assert not idle.should_end(now=1.0)
