"""Producer: determinism, dataset rows, and admission control against the learner's progress."""

from __future__ import annotations

import contextlib
import threading

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.envs import make_env
from streamrl.producer import WINDOW_FULL, Hold, LearnerAdmission, Producer
from streamrl.responses import row_to_prompt
from tests.support.waiting import wait_for


def test_same_seed_same_prompts_different_seed_different(r, run_name):
    env = make_env("counter")
    Producer(r, run_name).from_env(env, 5, 1, seed=1)
    Producer(r, run_name + "b").from_env(env, 5, 1, seed=1)
    Producer(r, run_name + "c").from_env(env, 5, 1, seed=2)

    def prompts(run):
        return [schema.TASK.decode(f[b"p"]).data for _, f in r.xrange(Keys(run).tasks)]

    assert prompts(run_name) == prompts(run_name + "b") != prompts(run_name + "c")


def test_nemo_gym_rows_become_tasks():
    row = (
        '{"responses_create_params": {"input": [{"role": "system", "content": "be brief"}, '
        '{"role": "user", "content": "2+2?"}]}, "expected": "4", "id": "q1", "reward": 1.0}'
    )
    items, data, pid = row_to_prompt(row)
    assert [(i.role, i.content) for i in items] == [("system", "be brief"), ("user", "2+2?")]
    assert data == {"expected": "4", "id": "q1"} and pid == "q1"  # a NeMo Gym row keeps its id
    _, data, pid = row_to_prompt('{"responses_create_params": {"input": "hi"}, "id": 0}')
    assert data == {"id": 0} and pid == "0"  # an id 0 is an id


def test_admission_blocks_until_samples_are_consumed(r, run_name):
    keys = Keys(run_name)
    env = make_env("counter")
    Producer(r, run_name).from_env(env, 4, 4)  # 16 samples in flight, no learner yet
    r.hset(keys.learner, mapping={"max_in_flight": 16, "samples_consumed": 0})
    told: list[Hold] = []  # every evaluation that held (tell_every_s=0: told each time)
    adm = LearnerAdmission(r, run_name, group_size=4, on_wait=told.append, tell_every_s=0)
    assert adm.in_flight() == (16, 16)
    released = threading.Event()

    def produce() -> None:  # two more prompts of the same source: 8 samples, 16 + 8 > 16
        Producer(r, run_name, admission=adm).from_env(env, 6, 4)
        released.set()

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    # held on three successive readings of the gate, and nothing got through meanwhile
    wait_for(lambda: len(told) >= 3, "the gate to hold the producer three times", timeout=60)
    assert not released.is_set() and t.is_alive()
    assert r.xinfo_stream(keys.tasks)["entries-added"] == 16
    assert {(h.reason, h.in_flight, h.limit) for h in told} == {(WINDOW_FULL, 16, 16)}
    r.hset(keys.learner, "samples_consumed", 8)
    assert released.wait(timeout=60), "the producer was not let through"
    assert r.xinfo_stream(keys.tasks)["entries-added"] == 24
    assert adm.in_flight() == (16, 16)
    # a dropped group settles its samples too
    r.hset(keys.stats, "groups_dropped", 2)
    assert adm.in_flight() == (8, 16)


class _CrashAfter(Exception):
    pass


def test_sharded_producer_stopped_between_shards_resumes_each_shard(r, run_name):
    """A producer that dies after pushing a batch to some shards and not others: the next one
    pushes each shard's missing prompts once, and prompt i lands in shard i mod 3."""
    env = make_env("counter")
    first = Producer(r, run_name, shards=3, batch_samples=8)  # 4 prompts a batch
    real, calls = first.scripts.produce, []

    def produce(**kw):
        calls.append(kw)
        if len(calls) == 6:  # second batch: shards 0 and 1 pushed, then the crash
            raise _CrashAfter
        return real(**kw)

    first.scripts.produce = produce
    with contextlib.suppress(_CrashAfter):
        first.from_env(env, 10, 2, seed=4)
    src = "env:counter:seed=4"
    assert [int(r.get(Keys(run_name, s, 3).producer(src))) for s in range(3)] == [8, 8, 4]
    assert first.position(src) == 4  # shard 2 still stands at prompt 4
    res = Producer(r, run_name, shards=3, batch_samples=8).from_env(env, 10, 2, seed=4)
    assert res.position == 10
    seen = []
    for s in range(3):
        for _, f in r.xrange(Keys(run_name, s, 3).tasks):
            task = schema.TASK.decode(f[b"p"])
            assert int(task.prompt_id.rsplit("-", 1)[1]) % 3 == s
            seen.append(task.task_id)
    assert sorted(seen) == sorted(f"counter-s4-{i:07d}:{k}" for i in range(10) for k in range(2))
