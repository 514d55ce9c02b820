"""A TRL GRPO script's reward functions score a run through real rq workers: TRL's documented
format reward and ``trl.rewards.think_format_reward``, weighted, on a conversational dataset;
a reward function that raises dead-letters its samples and drops their group: no 0 is ever
trained on."""

from __future__ import annotations

import json

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig, RunConfig
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.ops.drift import drift_report
from streamrl.producer.datasets import open_rows
from streamrl.producer.produce import Producer
from streamrl.workers.context import write_config

M = "tests.support.trl_rewards"
PROMPTS = 6
EXPLODE = 2  # this row's reward function raises


def test_trl_reward_functions_score_through_real_workers(redis_url, subprocess_env, tmp_path):
    path = tmp_path / "conv.jsonl"
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Think, then answer."},
                {"role": "user", "content": f"What is {i} + {i}?"},
            ],
            "answer": 2 * i,
            "explode": i == EXPLODE,
        }
        for i in range(PROMPTS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = RunConfig(
        run="trl-rewards",
        env="chat",
        env_options={"reference": "<think>adding</think><answer>{answer}</answer>"},
        group_size=4,
        policy=PolicyConfig(wrong_rate=0.25),
        verifier=[f"{M}:format_reward_func", "trl.rewards:think_format_reward", f"{M}:explodes"],
        reward_weights=[1.0, 0.5, 1.0],
    )
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        res = Producer(p.r, cfg.run).from_rows(open_rows(path), "chat", 4)
        assert res.prompts == PROMPTS and not res.rejected
        p.start_workers(rollout=1, verify=1)
        p.wait_groups(PROMPTS, timeout=120)
        scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]
        trajs = {t.task_id: t for t in p.trajectories()}
        dead = [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(p.r, Keys(cfg.run).dead)]
        dropped = p.stat("groups_dropped")
        same = drift_report(p.r, cfg.run)
        cfg.reward_weights = [1.0, 0.0, 1.0]  # think_format_reward no longer counts
        write_config(p.r, cfg)
        moved = drift_report(p.r, cfg.run)
    rewarded = [s for s in scores if s.reward is not None]
    failed = [s for s in scores if s.reward is None]
    # the exploding row: its four samples failed, none was scored, its group was dropped
    assert {s.prompt_id for s in failed} == {f"conv-{EXPLODE + 1:07d}"}
    assert all("reward backend unavailable" in s.failure for s in failed)
    assert len(dead) == 4 and all(d.stage == "verify" for d in dead)
    assert dropped == 1 and all(s.prompt_id != f"conv-{EXPLODE + 1:07d}" for s in rewarded)
    assert len(rewarded) == 4 * (PROMPTS - 1) and len(trajs) == len(rewarded)
    seen = set()
    for s in rewarded:
        text = trajs[s.task_id].items[-1].content
        right = text.endswith("</answer>")  # the scripted policy's wrong ones add " (or so)"
        seen.add(right)
        assert s.reward == (1.5 if right else 0.5), (text, s.reward)
        assert s.info["reward_functions"] == {
            "format_reward_func": 1.0 if right else 0.0,
            "think_format_reward": 1.0,
            "explodes": 0.0,
        }
        assert s.verifier == "reward-functions" and s.verifier_version
    assert seen == {True, False}
    # `streamrl reverify` re-scores with the run's reward functions: the same ones agree, and
    # new weights are a new version whose every reward moved by -0.5
    (row,) = same["drift"]
    assert row["samples"] == len(rewarded) and row["changed"] == row["failed"] == 0
    assert row["from_version"] == row["to_version"] == f"reward-functions/{s.verifier_version}"
    (row,) = moved["drift"]
    assert row["to_version"] != row["from_version"] and row["changed"] == len(rewarded)
    assert row["mean_delta"] == -0.5
