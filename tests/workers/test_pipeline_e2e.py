"""End to end with a real redis-server and real rq worker processes."""

from __future__ import annotations

from streamrl.config import PolicyConfig, RunConfig
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.producer.produce import Producer


def test_64_prompts_give_64_groups_of_4(redis_url, subprocess_env, tmp_path):
    cfg = RunConfig(run="e2e", env="counter", group_size=4, env_options={"steps": 2})
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(rollout=2, verify=1)
        res = Producer(p.r, "e2e").from_env(make_env("counter", steps=2), 64, 4, seed=3)
        assert res.samples == 256
        p.wait_groups(64, settled=False)
        acc = p.account(task_ids("counter", 3, 64, 4))
        trajs = p.trajectories()
    assert acc.groups == 64 and acc.malformed_groups == 0
    assert acc.lost == 0 and acc.duplicated == 0 and acc.failures == 0
    assert len(trajs) == 256
    # every episode ran the full 3-turn tool loop
    assert all(len(t.turns) == 3 and t.status == "completed" for t in trajs)
    # the scripted policy answers wrong in about a quarter of samples: rewards vary
    rewards = [t for t in trajs if t.state]
    assert 0 < sum(1 for t in rewards) <= 256


def test_restarted_producer_pushes_nothing_twice(r, run_name):
    env = make_env("counter")
    first = Producer(r, run_name).from_env(env, 10, 2, seed=1)
    again = Producer(r, run_name).from_env(env, 10, 2, seed=1)
    more = Producer(r, run_name).from_env(env, 15, 2, seed=1)
    assert (first.prompts, again.prompts, more.prompts) == (10, 0, 5)
    assert again.skipped == 10
    assert r.xlen(f"srl:{{{run_name}}}:tasks") == 30


def test_scripted_policy_is_deterministic(redis_url, subprocess_env, tmp_path):
    """Same tasks, same trajectories: the scripted policy depends only on the task id."""
    cfg = RunConfig(run="det", policy=PolicyConfig(wrong_rate=0.5), group_size=2)
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(rollout=1, verify=1)
        Producer(p.r, "det").from_env(make_env("counter"), 8, 2, seed=9)
        p.wait_groups(8)
        first = {t.task_id: t.items for t in p.trajectories()}
    from streamrl.schema import Message

    wrong = [items[-1] for items in first.values() if "(or so)" in items[-1].content]
    assert wrong and all(isinstance(m, Message) for m in wrong)
    assert len(first) == 16
