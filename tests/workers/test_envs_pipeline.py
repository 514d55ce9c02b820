"""Every built-in environment through the real pipeline, all in one run with interleaved
sessions: the scripted policy plays each environment's reference agent from its own session
state, so every sample scores the maximum only if no session saw another's state."""

from __future__ import annotations

import itertools

from streamrl import schema
from streamrl.config import PolicyConfig, RunConfig
from streamrl.envs import make_env
from streamrl.envs.registry import BUILTIN
from streamrl.local.pipeline import LocalPipeline, task_ids, xrange_all
from streamrl.producer.produce import Producer

PROMPTS = {"code": 2}  # each code sample runs its tests in the sandbox: keep it short


def test_every_builtin_env_scores_max_through_the_pipeline(redis_url, subprocess_env, tmp_path):
    names = sorted(BUILTIN)
    cfg = RunConfig(run="envs", env="counter", group_size=3, policy=PolicyConfig(wrong_rate=0.0))
    expected: set[str] = set()
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(rollout=2, verify=1)
        total = 0
        for name in names:
            n = PROMPTS.get(name, 6)
            Producer(p.r, cfg.run).from_env(make_env(name), n, 3, seed=11)
            expected |= task_ids(name, 11, n, 3)
            total += n
        p.wait_groups(total, timeout=240)
        acc = p.account(expected)
        trajs = p.trajectories()
        rewards = {}
        for _, f in xrange_all(p.r, p.keys.scored):
            score = schema.SCORE.decode(f[b"p"])
            rewards[score.task_id] = score.reward
    assert acc.lost == 0 and acc.duplicated == 0 and acc.groups == total
    by_env: dict[str, list] = {}
    for t in trajs:
        by_env.setdefault(t.env, []).append(t)
    assert set(by_env) == set(names)
    for name in names:
        env = make_env(name)
        got = [rewards[t.task_id] for t in by_env[name]]
        assert got and all(r == env.max_reward for r in got), (name, got)
    # the sessions really were interleaved: episodes of different prompts overlapped in time
    spans = sorted((t.started_at, t.finished_at, t.prompt_id) for t in trajs)
    overlaps = sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1] and a[2] != b[2])
    assert overlaps > 0
