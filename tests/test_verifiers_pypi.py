"""streamrl against PyPI ``verifiers`` 0.4.0 (PrimeIntellect): ``env = "verifiers"`` with the
``nemo_gym`` taskset verifiers ships, its ``null`` harness driving each episode against the
rollout worker's policy endpoint, the task's ``@vf.reward`` scoring in the verifier worker;
real rq workers, the work horse SIGKILLed twice right after answering a model turn
(bench/verifiers_env.py).

verifiers lives in ``.venv-verifiers`` at the repository's root (it pins openai < 3), made by
``python tests/support/verifiers_venv.py`` (about a minute, once). This test runs where it
exists (about 90 s) and is skipped, saying so, where it does not, or with
``STREAMRL_VERIFIERS_INSTALL=1`` makes it first."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.support.verifiers_venv import MARKER, ROOT, verifiers_python


@pytest.mark.skipif(
    not MARKER.exists() and not os.environ.get("STREAMRL_VERIFIERS_INSTALL"),
    reason="verifiers 0.4.0 not installed: python tests/support/verifiers_venv.py makes "
    ".venv-verifiers (or set STREAMRL_VERIFIERS_INSTALL=1)",
)
@pytest.mark.timeout(900)
def test_verifiers_nemo_gym_taskset_through_workers_with_kills(subprocess_env):
    python = verifiers_python()
    res = subprocess.run(
        [python, "bench/verifiers_env.py", "--prompts", "3", "--kills", "2"],
        cwd=ROOT, env=subprocess_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode in (0, 1), res.stderr[-4000:]
    out = json.loads(res.stdout)
    why = json.dumps(out)
    assert out["drained"] and out["kills"] == {"after_policy_turn": 2}, why
    # every sample scored once, by the task's own reward (even prompts 1.0, odd ones 0.0)
    assert out["scored"] == out["samples"] == 6 and out["scored_wrong"] == 0, why
    assert out["scored_twice"] == 0 and not out["dead_letters"], why
    assert out["reward_names_in_info"] == ["nemo_gym"], why
    # the episodes in flight at each kill were redone from the start as their next attempt;
    # a dead attempt's session was seeded and never verified
    assert out["redone_after_the_worker_lost_it"] >= 2, why
    assert out["server_sessions_verified"] == 6 and out["server_sessions_verified_twice"] == 0
    assert out["server_sessions"] > 6, why
    # each model turn came through the endpoint, with the policy's token ids
    assert out["model_turns_recorded"] >= 6 and out["samples_without_tokens"] == 0, why
    assert res.returncode == 0, res.stderr[-4000:]
