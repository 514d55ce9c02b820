"""The Lua scripts against a real redis-server: fencing, exactly-once results, group assembly,
dead-lettering, trimming and the producer's compare-and-set."""

from __future__ import annotations

import time

import msgspec
import pytest

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import (
    Scripts,
    claim_args,
    deadletter_call,
    ensure_groups,
    heartbeat_args,
    parse_claim,
    parse_read,
)
from streamrl.defaults import ROLLOUT_GROUP, VERIFY_GROUP


@pytest.fixture
def k(run_name):
    return Keys(run_name)


@pytest.fixture
def sc(r):
    return Scripts(r)


def _task(i: int, k: int = 0, size: int = 2) -> schema.Task:
    return schema.Task(
        task_id=f"p{i}:{k}", prompt_id=f"p{i}", k=k, group_size=size, env="counter", input=[]
    )


def _push(r, k, tasks):
    for t in tasks:
        r.xadd(k.tasks, {"id": t.task_id, "p": schema.encode(t)})


def _read(r, k, consumer, stream=None, group=ROLLOUT_GROUP):
    return parse_read(r.xreadgroup(group, consumer, {stream or k.tasks: ">"}, count=100))


def test_stale_fence_cannot_commit_or_finish(r, k, sc):
    ensure_groups(r, k)
    _push(r, k, [_task(0)])
    (e,) = _read(r, k, "A")
    assert e.fence == 1
    sess = schema.encode(schema.Session(task_id=e.task_id, items=[]))
    ok = sc.commit(
        keys=[k.tasks, k.session(e.task_id)], args=[ROLLOUT_GROUP, "A", 60, e.id, 1, sess]
    )
    assert ok == [1]
    # B takes the entry over (A looks dead): the delivery count, our fence, moves to 2
    time.sleep(0.02)
    _cursor, claimed = parse_claim(
        sc.claim(
            keys=[k.tasks], args=claim_args(ROLLOUT_GROUP, "B", 10, 10, "0-0", False, k.session(""))
        )
    )
    assert [c.fence for c in claimed] == [2]
    assert claimed[0].session == sess  # B resumes from A's committed session
    # A, unaware, tries to commit and to finish: both refused
    ok = sc.commit(
        keys=[k.tasks, k.session(e.task_id)], args=[ROLLOUT_GROUP, "A", 60, e.id, 1, b"x"]
    )
    assert ok == [0]
    fin = sc.finish(
        keys=[k.tasks, k.rollouts, k.stats, k.session(e.task_id)],
        args=[ROLLOUT_GROUP, "A", e.id, 1, e.task_id, b"traj-A"],
    )
    assert fin == [0]
    # B with the wrong (old) fence is refused too; with its own it writes once and acks
    fin = sc.finish(
        keys=[k.tasks, k.rollouts, k.stats, k.session(e.task_id)],
        args=[ROLLOUT_GROUP, "B", e.id, 1, e.task_id, b"traj-B"],
    )
    assert fin == [0]
    fin = sc.finish(
        keys=[k.tasks, k.rollouts, k.stats, k.session(e.task_id)],
        args=[ROLLOUT_GROUP, "B", e.id, 2, e.task_id, b"traj-B"],
    )
    assert fin == [1]
    assert [f[b"p"] for _, f in r.xrange(k.rollouts)] == [b"traj-B"]
    assert r.xpending(k.tasks, ROLLOUT_GROUP)["pending"] == 0
    assert not r.exists(k.session(e.task_id))
    # a re-sent finish (client retry) cannot write a second trajectory
    fin = sc.finish(
        keys=[k.tasks, k.rollouts, k.stats, k.session(e.task_id)],
        args=[ROLLOUT_GROUP, "B", e.id, 2, e.task_id, b"traj-B"],
    )
    assert fin == [0] and r.xlen(k.rollouts) == 1


def test_heartbeat_keeps_entries_and_reports_lost_ones(r, k, sc):
    ensure_groups(r, k)
    _push(r, k, [_task(0), _task(1)])
    a, b = _read(r, k, "A")
    time.sleep(0.4)
    lost = sc.heartbeat(keys=[k.tasks], args=heartbeat_args(ROLLOUT_GROUP, "A", [a, b]))
    assert lost == []
    # the heartbeat reset idle time: a claim for entries idle >= 300 ms finds nothing
    # (wide margins so a loaded CI machine cannot let 300 ms pass between the two calls)
    _, claimed = parse_claim(
        sc.claim(keys=[k.tasks], args=claim_args(ROLLOUT_GROUP, "B", 300, 10, "0-0", False, ""))
    )
    assert claimed == []
    time.sleep(0.05)
    r.xclaim(k.tasks, ROLLOUT_GROUP, "B", 0, [b.id])
    lost = sc.heartbeat(keys=[k.tasks], args=heartbeat_args(ROLLOUT_GROUP, "A", [a, b]))
    assert [x.decode() for x in lost] == [b.id]


def _score_call(k, items, size=2):
    keys = [k.rollouts, k.scored, k.groups, k.stats]
    args = [VERIFY_GROUP, "V", 1, 3600]
    for e, reward in items:
        t = schema.TASK.decode(e.payload)
        score = schema.Score(task_id=t.task_id, prompt_id=t.prompt_id, k=t.k, reward=reward)
        traj = schema.Trajectory(
            task_id=t.task_id,
            prompt_id=t.prompt_id,
            k=t.k,
            group_size=size,
            env="counter",
            items=[],
            turns=[],
            status="completed",
        )
        keys.append(k.group(t.prompt_id))
        args += [e.id, e.fence, t.task_id, t.prompt_id, t.k, size, repr(reward)]
        args += [schema.encode(score), schema.encode(schema.Sample(score=score, trajectory=traj))]
    return keys, args


def test_group_is_assembled_once_and_duplicates_are_ignored(r, k, sc):
    ensure_groups(r, k)
    for t in [_task(0, 0, 3), _task(0, 1, 3), _task(0, 2, 3)]:
        r.xadd(k.rollouts, {"id": t.task_id, "p": schema.encode(t)})
    e0, e1, e2 = _read(r, k, "V", k.rollouts, VERIFY_GROUP)
    keys, args = _score_call(k, [(e0, 1.0), (e1, 0.0)], size=3)
    assert sc.score(keys=keys, args=args) == [1, 1]
    assert r.xlen(k.groups) == 0
    # the same sample scored again (redelivered elsewhere and re-read) is acked, not added
    r.xadd(k.rollouts, {"id": "p0:1", "p": e1.payload})
    (e1b,) = _read(r, k, "V", k.rollouts, VERIFY_GROUP)
    keys, args = _score_call(k, [(e1b, 1.0), (e2, 0.5)], size=3)
    assert sc.score(keys=keys, args=args) == [2, 1]
    ((_gid, fields),) = r.xrange(k.groups)
    g = schema.GROUP.decode(fields[b"p"])
    assert g.prompt_id == "p0" and g.group_size == 3
    assert sorted((s.score.k, s.score.reward) for s in g.samples) == [(0, 1.0), (1, 0.0), (2, 0.5)]
    assert g.reward_mean == pytest.approx(0.5)
    assert g.reward_std == pytest.approx((((0.5**2) * 2) / 3) ** 0.5)
    assert r.xlen(k.scored) == 3
    assert r.xpending(k.rollouts, VERIFY_GROUP)["pending"] == 0
    assert int(r.hget(k.stats, "groups_completed")) == 1


def test_group_header_decodes_with_many_samples(r, k, sc):
    """More than 15 samples needs the 16-bit msgpack array header in the Lua script."""
    ensure_groups(r, k)
    size = 20
    for i in range(size):
        t = _task(7, i, size)
        r.xadd(k.rollouts, {"id": t.task_id, "p": schema.encode(t)})
    entries = _read(r, k, "V", k.rollouts, VERIFY_GROUP)
    keys, args = _score_call(k, [(e, float(i % 2)) for i, e in enumerate(entries)], size=size)
    assert sc.score(keys=keys, args=args) == [1] * size
    g = schema.GROUP.decode(r.xrange(k.groups)[0][1][b"p"])
    assert len(g.samples) == size and g.reward_mean == pytest.approx(0.5)


def test_deadletter_drops_group_and_later_samples_are_ignored(r, k, sc):
    ensure_groups(r, k)
    for t in [_task(3, 0), _task(3, 1)]:
        r.xadd(k.rollouts, {"id": t.task_id, "p": schema.encode(t)})
    e0, e1 = _read(r, k, "V", k.rollouts, VERIFY_GROUP)
    dl = schema.encode(schema.DeadLetter(stage="verify", entry_id=e0.id, reason="boom"))
    keys, args = deadletter_call(k, k.rollouts, VERIFY_GROUP, "V", [(e0, dl, b"")], False)
    assert sc.deadletter(keys=keys, args=args) == [1]
    keys, args = _score_call(k, [(e1, 1.0)])
    assert sc.score(keys=keys, args=args) == [2]
    assert r.xlen(k.groups) == 0
    assert int(r.hget(k.stats, "groups_dropped")) == 1
    ((_, f),) = r.xrange(k.dead)
    assert schema.DEAD_LETTER.decode(f[b"p"]).reason == "boom"


def test_trim_never_drops_what_a_group_still_needs(r, k, sc):
    ensure_groups(r, k)
    _push(r, k, [_task(i) for i in range(10)])
    # nothing delivered yet: nothing may go
    assert sc.trim(keys=[k.tasks], args=[0, int(time.time() * 1000) + 10_000]) == 0
    entries = parse_read(r.xreadgroup(ROLLOUT_GROUP, "A", {k.tasks: ">"}, count=6))
    for e in entries[:4]:
        r.xack(k.tasks, ROLLOUT_GROUP, e.id)
    # 4 acked, 2 pending, 4 undelivered: only the 4 acked may go
    assert sc.trim(keys=[k.tasks], args=[0, int(time.time() * 1000) + 10_000]) == 4
    assert r.xlen(k.tasks) == 6
    # a retention window keeps even acked entries
    r.xack(k.tasks, ROLLOUT_GROUP, entries[4].id)
    assert sc.trim(keys=[k.tasks], args=[3_600_000, int(time.time() * 1000)]) == 0


def test_produce_is_compare_and_set(r, k, sc):
    t = _task(0)
    args = ["0", "1", t.task_id, schema.encode(t)]
    assert sc.produce(keys=[k.tasks, k.producer("s")], args=args) == 1
    assert sc.produce(keys=[k.tasks, k.producer("s")], args=args) == -1  # a re-sent batch
    assert r.xlen(k.tasks) == 1


def test_undecodable_group_payload_is_a_decode_error():
    with pytest.raises(msgspec.DecodeError):
        schema.GROUP.decode(b"\x96\x01")


@pytest.mark.parametrize(
    ("k_arg", "size_arg", "reward_arg"),
    [
        (2, 2, "1.0"),  # k == group_size: a slot the group does not have
        (-1, 2, "1.0"),
        (0, 0, "1.0"),  # group_size 0: the group could never complete
        (0, -3, "1.0"),
        ("1.5", 2, "1.0"),
        ("x", 2, "1.0"),
        (0, "two", "1.0"),
        (0, 70000, "1.0"),  # wider than the group header the script can write
        (0, 2, "nan"),
        (0, 2, "inf"),
        (0, 2, "high"),
    ],
)
def test_score_refuses_impossible_items_without_failing_the_batch(
    r, k, sc, k_arg, size_arg, reward_arg
):
    """The script checks its own inputs: a bad item is refused (3) and stays pending for the
    worker to dead-letter, and the good items of the same call are scored."""
    ensure_groups(r, k)
    for t in [_task(0, 0), _task(0, 1), _task(9, 0)]:
        r.xadd(k.rollouts, {"id": t.task_id, "p": schema.encode(t)})
    e0, e1, bad = _read(r, k, "V", k.rollouts, VERIFY_GROUP)
    keys, args = _score_call(k, [(e0, 1.0), (bad, 1.0), (e1, 0.0)])
    args[4 + 9 + 4 : 4 + 9 + 7] = [k_arg, size_arg, reward_arg]
    assert sc.score(keys=keys, args=args) == [1, 3, 1]
    assert r.xlen(k.groups) == 1  # p0 completed
    pending = r.xpending_range(k.rollouts, VERIFY_GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [bad.id]
    assert r.hget(k.group("p9"), "n") is None


def test_score_refuses_a_sample_whose_group_size_disagrees_with_its_group(r, k, sc):
    ensure_groups(r, k)
    for t in [_task(4, 0, 3), _task(4, 1, 2), _task(4, 1, 3), _task(4, 2, 3)]:
        r.xadd(k.rollouts, {"id": t.task_id, "p": schema.encode(t)})
    a, b, c, d = _read(r, k, "V", k.rollouts, VERIFY_GROUP)
    keys, args = _score_call(k, [(a, 1.0), (b, 0.0)], size=3)
    args[4 + 9 + 5] = 2  # b claims a group of 2 in a group whose first sample said 3
    assert sc.score(keys=keys, args=args) == [1, 3]
    keys, args = _score_call(k, [(c, 0.0), (d, 0.5)], size=3)
    assert sc.score(keys=keys, args=args) == [1, 1]
    g = schema.GROUP.decode(r.xrange(k.groups)[0][1][b"p"])
    assert g.group_size == 3 and sorted(s.score.k for s in g.samples) == [0, 1, 2]


def _command_calls(r) -> dict[str, int]:
    return {k.removeprefix("cmdstat_"): v["calls"] for k, v in r.info("commandstats").items()}


def _commands_since(r, before: dict[str, int], skip=("info", "evalsha", "script|load")) -> dict:
    now = _command_calls(r)
    return {
        k: n - before.get(k, 0) for k, n in now.items() if n != before.get(k, 0) and k not in skip
    }


def test_a_batch_pays_one_command_per_entry_written_and_one_per_group(r, k, sc):
    """Redis's work per trajectory (issue 24): a batch's fence check, acks and session deletes
    are one command each, whatever the batch's size, and each group of a scoring batch is read
    once and, when it completes, written to `groups` and closed with one command each."""
    ensure_groups(r, k)
    _push(r, k, [_task(p, i, 4) for p in range(2) for i in range(4)])
    entries = _read(r, k, "A")
    before = _command_calls(r)
    assert sc.heartbeat(keys=[k.tasks], args=heartbeat_args(ROLLOUT_GROUP, "A", entries)) == []
    assert _commands_since(r, before) == {"xpending": 1, "xclaim": 1}
    keys = [k.tasks, k.rollouts, k.stats] + [k.session(e.task_id) for e in entries]
    args: list = [ROLLOUT_GROUP, "A"]
    for e in entries:
        args += [e.id, e.fence, e.task_id, e.payload]
    before = _command_calls(r)
    assert sc.finish(keys=keys, args=args) == [1] * 8
    assert _commands_since(r, before) == {
        "xpending": 1,
        "xadd": 8,
        "xack": 1,
        "del": 1,
        "hincrby": 1,
    }
    rollouts = _read(r, k, "V", k.rollouts, VERIFY_GROUP)
    keys, args = _score_call(k, [(e, float(i % 2)) for i, e in enumerate(rollouts)], size=4)
    before = _command_calls(r)
    assert sc.score(keys=keys, args=args) == [1] * 8
    # 8 scores and 2 groups written, each group read once (HMGET) and closed once (SET)
    assert _commands_since(r, before) == {
        "xpending": 1, "xadd": 10, "hmget": 2, "set": 2, "xack": 1, "hincrby": 2
    }  # fmt: skip
    assert [schema.GROUP.decode(f[b"p"]).prompt_id for _, f in r.xrange(k.groups)] == ["p0", "p1"]


def test_groups_written_by_the_previous_scripts_are_read_as_they_were(r, k, sc):
    """A rolling upgrade: a group half filled by the previous SCORE script (a hash with
    ``s<k>``, ``r<k>``, ``size``, ``n``) completes, and its closed-group marker (a hash with
    ``state``) keeps refusing samples, for scoring and for dead-lettering alike."""
    ensure_groups(r, k)
    for t in [_task(5, 1), _task(6, 0), _task(6, 1)]:
        r.xadd(k.rollouts, {"id": t.task_id, "p": schema.encode(t)})
    e51, e60, e61 = _read(r, k, "V", k.rollouts, VERIFY_GROUP)
    first = schema.Sample(
        score=schema.Score(task_id="p5:0", prompt_id="p5", k=0, reward=1.0),
        trajectory=schema.Trajectory(
            task_id="p5:0", prompt_id="p5", k=0, group_size=2, env="counter", items=[],
            turns=[], status="completed",
        ),
    )  # fmt: skip
    r.hset(k.group("p5"), mapping={"s0": schema.encode(first), "r0": "1.0", "size": 2, "n": 1})
    r.hset(k.group("p6"), "state", "done")
    keys, args = _score_call(k, [(e51, 0.0), (e60, 1.0)])
    assert sc.score(keys=keys, args=args) == [1, 2]
    g = schema.GROUP.decode(r.xrange(k.groups)[0][1][b"p"])
    assert g.prompt_id == "p5" and [s.score.reward for s in g.samples] == [1.0, 0.0]
    dl = schema.encode(schema.DeadLetter(stage="verify", entry_id=e61.id, reason="boom"))
    keys, args = deadletter_call(k, k.rollouts, VERIFY_GROUP, "V", [(e61, dl, b"")], False)
    assert sc.deadletter(keys=keys, args=args) == [1]
    assert r.hget(k.stats, "groups_dropped") is None  # p6 was closed already
