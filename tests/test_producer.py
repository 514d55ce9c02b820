"""Producer: determinism, dataset rows, and admission control against the learner's progress."""

from __future__ import annotations

import threading
import time

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.envs import make_env
from streamrl.producer import LearnerAdmission, Producer, row_to_prompt


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
    assert data == {"expected": "4"} and pid == "q1"


def test_admission_blocks_until_samples_are_consumed(r, run_name):
    keys = Keys(run_name)
    env = make_env("counter")
    Producer(r, run_name).from_env(env, 4, 4)  # 16 samples in flight, no learner yet
    r.hset(keys.learner, mapping={"max_in_flight": 16, "samples_consumed": 0})
    adm = LearnerAdmission(r, run_name, group_size=4)
    assert adm.in_flight() == (16, 16)
    released = threading.Event()

    def wait():
        adm(8)
        released.set()

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.3)
    assert not released.is_set()  # 16 + 8 > 16
    r.hset(keys.learner, "samples_consumed", 8)
    t.join(timeout=5)
    assert released.is_set()
    # a dropped group settles its samples too
    r.hset(keys.stats, "groups_dropped", 2)
    assert adm.in_flight() == (0, 16)
