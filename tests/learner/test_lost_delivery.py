"""A delivery whose reply never reached the learner (redis-py re-sends XREADGROUP after a
dropped connection) is found in the learner's own pending list and trained on, not stranded."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from groupdata import make_groups

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.defaults import LEARNER_GROUP
from streamrl.learner.config import LearnerConfig
from streamrl.learner.loop import run_learner
from tests.support.waiting import wait_for


@contextmanager
def _learner(redis_url: str, r, run: str, tiny_dir, tmp_path) -> Iterator[tuple]:
    """An in-process learner on ``run`` until 3 s without a group, its progress hash up:
    yields its keys, its config and the dict its final state lands in (``state``)."""
    torch_threads = torch.get_num_threads()
    keys = Keys(run)
    ensure_groups(r, keys)
    cfg = LearnerConfig(
        model=str(tiny_dir), output_dir=str(tmp_path / "out"), torch_threads=1, batch_groups=2,
        checkpoint_every=1, sync_every=1, lr=1e-3, block_ms=100, max_staleness=100,
    )  # fmt: skip
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(state=run_learner(redis_url, run, cfg, exit_when_idle=3.0))
    )
    t.start()
    try:
        wait_for(lambda: r.hget(keys.learner, "step"), "the learner to be up and reading", 60)
        yield keys, cfg, box
    finally:
        t.join(120)
        torch.set_num_threads(torch_threads)


def test_entries_delivered_but_never_seen_are_taken(redis_url, r, tiny_dir, tmp_path):
    groups = make_groups(tiny_dir, 4, seed=11)
    with _learner(redis_url, r, "lost", tiny_dir, tmp_path) as (keys, cfg, box):
        # add and deliver in one transaction: the learner's blocked read cannot win the race,
        # exactly as if its own read had been served and the reply lost on the wire
        pipe = r.pipeline(transaction=True)
        for g in groups:
            pipe.xadd(keys.groups, {"id": g.prompt_id, "p": schema.encode(g)})
        pipe.xreadgroup(LEARNER_GROUP, cfg.consumer, {keys.groups: ">"})
        delivered = pipe.execute()[-1]
        assert len(delivered[0][1]) == 4
    assert box["state"].step >= 1
    # committed counters plus the open window: every delivered entry was taken, once
    assert int(r.hget(keys.learner, "groups_consumed")) == 4


def test_entries_handed_out_again_after_a_failover_are_not_taken_twice(
    redis_url, r, tiny_dir, tmp_path
):
    """A Redis Cluster failover can lose the old master's last writes, the consumer group's
    last-delivered id among them, and ``XREADGROUP >`` then hands out entries the learner
    already took (a failover test once saw 100 of 96 groups taken). ``XGROUP SETID`` back to
    the start is that lost write; the learner skips what it took and acks what it committed."""
    groups = make_groups(tiny_dir, 6, seed=12)
    with _learner(redis_url, r, "again", tiny_dir, tmp_path) as (keys, _cfg, box):
        for g in groups[:4]:
            r.xadd(keys.groups, {"id": g.prompt_id, "p": schema.encode(g)})
        wait_for(lambda: int(r.hget(keys.learner, "step") or 0) >= 2, "two steps", 60)
        r.xgroup_setid(keys.groups, LEARNER_GROUP, "0")  # the failover lost the delivery
        for g in groups[4:]:
            r.xadd(keys.groups, {"id": g.prompt_id, "p": schema.encode(g)})
    state = box["state"]
    assert state.step == 3 and state.counters.groups_consumed == 6, state
    assert int(r.hget(keys.learner, "groups_consumed")) == 6
    assert r.xpending(keys.groups, LEARNER_GROUP)["pending"] == 0  # all committed and acked
