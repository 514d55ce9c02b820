"""End to end with a real redis-server and real rq worker processes."""

from __future__ import annotations

from pathlib import Path

import redis

from streamrl import schema
from streamrl.bus.streams import xrange_all
from streamrl.config import PolicyConfig, RunConfig
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.producer.produce import Producer


def _groups(p: LocalPipeline) -> list[schema.Group]:
    """Every group the verifiers closed, as the learner would read it."""
    return [
        schema.GROUP.decode(f[b"p"])
        for stream in p.streams("groups")
        for _, f in xrange_all(p.r, stream)
    ]


def _answer(t: schema.Trajectory) -> str:
    last = t.items[-1]
    assert isinstance(last, schema.Message), last
    return last.content


def test_64_prompts_give_64_groups_of_4(redis_url, subprocess_env, tmp_path):
    cfg = RunConfig(run="e2e", env="counter", group_size=4, env_options={"steps": 2})
    env = make_env("counter", steps=2)
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(rollout=2, verify=1)
        res = Producer(p.r, "e2e").from_env(env, 64, 4, seed=3)
        assert res.samples == 256
        p.wait_groups(64, settled=False)
        acc = p.account(task_ids("counter", 3, 64, 4))
        trajs = p.trajectories()
        groups = _groups(p)
    assert acc.groups == 64 and acc.malformed_groups == 0
    assert acc.lost == 0 and acc.duplicated == 0 and acc.failures == 0
    assert len(trajs) == 256
    # every episode ran the full 3-turn tool loop
    assert all(len(t.turns) == 3 and t.status == "completed" for t in trajs)
    # each sample carries the reward the environment's verifier gives its own trajectory ...
    samples = [s for g in groups for s in g.samples]
    for s in samples:
        t = s.trajectory
        want = env.verify(t.task(), t, env.decode_state(t.state))
        assert s.score.task_id == t.task_id
        assert (s.score.reward, s.score.components) == (want.reward, want.components), t.task_id
    for g in groups:
        rewards = [s.score.reward for s in g.samples]
        assert abs(g.reward_mean - sum(rewards) / len(rewards)) < 1e-9, g.prompt_id
    # ... and that reward is right: the scripted policy answers wrong ("... (or so)") in about a
    # quarter of samples, exactly those score 0, the rest (right answer, every add made) 1
    wrong = {t.task_id for t in trajs if _answer(t).endswith(" (or so)")}
    zero = {s.score.task_id for s in samples if s.score.reward == 0.0}
    one = {s.score.task_id for s in samples if s.score.reward == 1.0}
    assert zero == wrong and len(one) == 256 - len(wrong)
    assert 256 // 8 < len(wrong) < 256 // 2


def test_restarted_producer_pushes_nothing_twice(r, run_name):
    env = make_env("counter")
    first = Producer(r, run_name).from_env(env, 10, 2, seed=1)
    again = Producer(r, run_name).from_env(env, 10, 2, seed=1)
    more = Producer(r, run_name).from_env(env, 15, 2, seed=1)
    assert (first.prompts, again.prompts, more.prompts) == (10, 0, 5)
    assert again.skipped == 10
    assert r.xlen(f"srl:{{{run_name}}}:tasks") == 30


def _seeded_run(url: str, env: dict, directory: Path, rollout_workers: int) -> dict:
    """One run of the same seeded tasks on a flushed Redis: per task id, everything the
    scripted policy and the verifier decided (not who ran it or when)."""
    client = redis.Redis.from_url(url)
    client.flushall()
    client.close()
    cfg = RunConfig(run="det", policy=PolicyConfig(wrong_rate=0.5), group_size=2)
    with LocalPipeline(cfg, url=url, directory=directory, worker_env=env) as p:
        p.start_workers(rollout=rollout_workers, verify=1)
        Producer(p.r, "det").from_env(make_env("counter"), 8, 2, seed=9)
        p.wait_groups(8)
        groups = _groups(p)
    return {
        s.trajectory.task_id: (
            g.prompt_id,
            s.trajectory.items,
            s.trajectory.state,
            s.trajectory.status,
            s.score.reward,
            s.score.components,
            s.score.details,
        )
        for g in groups
        for s in g.samples
    }


def test_scripted_policy_is_deterministic(redis_url, subprocess_env, tmp_path):
    """Same tasks, same trajectories: the scripted policy depends only on the task id, not on
    how many workers share the tasks or in which order they run them."""
    first = _seeded_run(redis_url, subprocess_env, tmp_path / "first", rollout_workers=1)
    second = _seeded_run(redis_url, subprocess_env, tmp_path / "second", rollout_workers=2)
    assert set(first) == task_ids("counter", 9, 8, 2)
    assert second == first
    # the comparison has something to compare: both answers, and both rewards, occur
    rewards = [reward for *_, reward, _, _ in first.values()]
    wrong = [items[-1] for _, items, *_ in first.values() if "(or so)" in items[-1].content]
    assert wrong and all(isinstance(m, schema.Message) for m in wrong)
    assert 0.0 in rewards and 1.0 in rewards
