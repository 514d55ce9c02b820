"""streamrl against the PyPI ``nemo-gym`` releases 0.7.0 and 0.4.0 (bench/nemo_gym_pypi.py):
the same environment drives each release's servers, its own and ours, finding the seed protocol
by itself (0.7: typed seeds, ``episode_id`` attempts, ``/close_session``; 0.4: the row); a judge
that fails is a masked sample, dead-lettered by kind, never a reward; exported rows pass each
release's pydantic models, its ``/aggregate_metrics`` and 0.7's ``gym eval aggregate``. And
``mode=run`` against the environment servers 0.7.0 ships (bench/nemo_gym_env_servers.py).

The releases live in virtualenvs of their own at the repository's root, made by
tests/support/nemo_gym_venv.py (``python tests/support/nemo_gym_venv.py 0.7.0``, and ``0.4.0``;
minutes each, once). This test runs wherever both exist (a CI machine keeps them between runs:
the test then takes about 2.5 minutes) and is skipped, saying so, where they do not, or with
``STREAMRL_NEMO_GYM_INSTALL=1`` makes them first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.nemo_gym_venv import RELEASES, nemo_gym_python, venv_python

ROOT = Path(__file__).resolve().parent.parent
MISSING = [v for v in RELEASES if not venv_python(v).exists()]


@pytest.mark.skipif(
    bool(MISSING) and not os.environ.get("STREAMRL_NEMO_GYM_INSTALL"),
    reason=f"nemo-gym {', '.join(MISSING)} not installed: python tests/support/nemo_gym_venv.py "
    "VERSION makes each (or set STREAMRL_NEMO_GYM_INSTALL=1)",
)
@pytest.mark.timeout(1500)
def test_both_nemo_gym_releases(subprocess_env):
    for version in RELEASES:
        nemo_gym_python(version)
    res = subprocess.run(
        [sys.executable, "bench/nemo_gym_pypi.py", "--nemo-gym", "0.7.0,0.4.0", "--prompts", "4"],
        cwd=ROOT, env=subprocess_env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr[-4000:]
    out = json.loads(res.stdout)
    new, old = out["0.7.0"], out["0.4.0"]

    c = new["counter"]
    assert c["ok"], c
    assert c["seed_protocol"] == ["typed"] and c["episode_attempts"] == [0], c
    assert c["server_sessions"] == c["server_sessions_closed"] == c["server_seeds"] == 16, c
    assert c["rows_validated_by_nemo_gym_models"] == 16, c
    agg, gym = c["aggregate_metrics"], c["gym_eval_aggregate"]
    assert agg["status"] == 200 and agg["tasks"] == 4 and agg["rollouts_per_task"] == [4], agg
    assert agg["mean_reward"] == 1.0 and agg["without_ng_keys_status"] == 500, agg
    assert gym["returncode"] == 0 and gym["servers"] == ["streamrl"] and gym["tasks"] == [4], gym
    assert gym["key_metrics"][0]["mean/reward"] == 1.0 and gym["merged_rows"] == 16, gym

    shipped = new["shipped"]
    assert shipped["example_single_tool_call"]["seed_protocol"] == ["typed"], shipped
    assert shipped["example_session_state_mgmt"]["seed_protocol"] == ["legacy"], shipped
    assert all(s["ok"] and s["mean_reward"] == 1.0 for s in shipped.values()), shipped

    judge = new["judge"]
    assert judge["ok"], judge
    assert judge["status_masked"] == {"judge_failed": 4} and judge["scored"] == 4, judge
    assert judge["reward_components"] == {"format": 1.0, "correct": 1.0}, judge

    tokens = new["tokens"]  # complete token sets validate as 0.7's training items
    assert tokens["ok"] and tokens["complete"][0].endswith("ForTraining"), tokens
    assert tokens["partial_written_anyway"].startswith("refused"), tokens

    c = old["counter"]
    assert c["ok"], c
    assert c["seed_protocol"] == ["legacy"] and c["server_sessions_closed"] == 0, c
    assert c["aggregate_metrics"]["status"] == 200 and c["aggregate_metrics"]["tasks"] == 4, c
    other = c["aggregate_metrics_of_other_release_rows"]  # 0.7.0's rows, aggregated by 0.4.0
    assert other["status"] == 200 and other["tasks"] == 4 and other["mean_reward"] == 1.0, other
    assert all(s["ok"] and s["seed_protocol"] == ["legacy"] for s in old["shipped"].values())
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.skipif(
    not venv_python("0.7.0").exists() and not os.environ.get("STREAMRL_NEMO_GYM_INSTALL"),
    reason="nemo-gym 0.7.0 not installed: python tests/support/nemo_gym_venv.py 0.7.0",
)
@pytest.mark.timeout(900)
def test_nemo_gym_0_7_environment_servers(subprocess_env):
    """nemo-gym mode=run against the environment servers 0.7.0 ships (bench/
    nemo_gym_env_servers.py): single_agent_turn and legacy_agent in front of the wheel's
    simple_agent, whose model server is the rollout worker's policy endpoint; two work-horse
    SIGKILLs after a model turn in each; about a minute."""
    nemo_gym_python("0.7.0")
    res = subprocess.run(
        [sys.executable, "bench/nemo_gym_env_servers.py", "--prompts", "4", "--kills", "2"],
        cwd=ROOT, env=subprocess_env, capture_output=True, text=True, timeout=800,
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr[-4000:]
    out = json.loads(res.stdout)
    w = out["weather_single_agent_turn"]  # the wheel's example_single_tool_call, its own rows
    assert w["scored"] == 10 and w["mean_reward"] == 1.0 and not w["dead_letters"], w
    assert w["samples_without_tokens"] == 0 and w["model_turns_recorded"] == 20, w
    s = out["counter_single_agent_turn"]
    assert s["kills"] == {"after_policy_turn": 2} and s["scored"] == 8, s
    assert s["scored_0"] == 0 and s["scored_twice"] == 0 and s["calls_applied_twice"] == 0, s
    assert s["sessions_not_as_recorded"] == 0 and s["sessions_verified"] == 8, s
    assert s["sessions_leaked"] == 0 and s["sessions_closed"] == s["sessions_seeded"], s
    assert all(a != "0" for a in s["verified_attempts"]), s  # the killed ones, redone
    legacy = out["counter_legacy_agent"]  # the agent's legacy /run never closes its session
    assert legacy["kills"] == {"after_policy_turn": 2} and legacy["scored"] == 8, legacy
    assert legacy["scored_0"] == 0 and legacy["scored_twice"] == 0, legacy
    assert legacy["sessions_closed"] == 0 and legacy["sessions_verified"] == 8, legacy
    assert out["nemo_user_sim"]["runs"] is False
    assert res.returncode == 0, res.stderr[-4000:]
