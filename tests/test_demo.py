"""`streamrl demo`'s machinery end to end, on a step budget (timing lives in the demo itself):
private Redis, producer under admission control, rq rollout workers on the hf backend, the
verifier, the learner process; policy versions flow back to the rollout workers."""

from __future__ import annotations

import pytest

from streamrl.demo import train_demo


# prefork on: the learner and rollout workers forked from one process that imported torch
# (the default); off: each its own `python -m` process
@pytest.mark.parametrize("prefork", ["1", "0"])
def test_demo_trains_and_rollouts_follow_new_policy_versions(tmp_path, monkeypatch, prefork):
    monkeypatch.setenv("STREAMRL_PREFORK", prefork)
    res = train_demo(seconds=180, target=None, live=False, directory=tmp_path, max_steps=12)
    assert res["learner_steps"] >= 12
    assert res["groups_trained"] >= 12 * 8
    assert res["policy_version"] >= 6  # published every 2 steps, v0 at start
    assert res["newest_rollout_version"] >= 1, "rollout workers never loaded a new version"
    assert 0.0 <= res["reward_first"] <= 0.3  # the untrained tiny model is near chance (1/16)
    assert res["samples_scored"] >= 12 * 64
    assert ("prefork" in res["cpu_seconds"]) == (prefork == "1")  # the fork server's own CPU
    log = (tmp_path / "logs" / "learner.log").read_text()
    assert "published" in log and "Traceback" not in log
