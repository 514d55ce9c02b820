"""Opt-in: streamrl against the PyPI ``nemo-gym`` package (Python >= 3.12, Ray): its
``SimpleResourcesServer`` serves the rollouts and the rewards of a short training run, its
pydantic models validate the exported rows, and its ``/aggregate_metrics`` aggregates them.
Runs bench/nemo_gym_pypi.py.

    STREAMRL_NEMO_GYM_PYTHON=.venv-nemo-gym/bin/python pytest tests/test_nemo_gym_pypi.py

(``python bench/nemo_gym_pypi.py`` creates that virtualenv on first use.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = os.environ.get("STREAMRL_NEMO_GYM_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not PYTHON,
    reason="opt-in: set STREAMRL_NEMO_GYM_PYTHON to a Python >= 3.12 with nemo-gym installed "
    "(python bench/nemo_gym_pypi.py creates .venv-nemo-gym)",
)


@pytest.mark.timeout(900)
def test_rollouts_and_training_through_pypi_nemo_gym(subprocess_env):
    res = subprocess.run(
        [sys.executable, "bench/nemo_gym_pypi.py", "--nemo-gym-python", PYTHON,
         "--prompts", "8", "--train-steps", "6", "--seconds", "600"],
        cwd=ROOT, env=subprocess_env, capture_output=True, text=True, timeout=880,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout)
    counter, copy = out["counter"], out["copy_training"]
    assert counter["ok"] and counter["rows_validated_by_nemo_gym_models"] == 32, counter
    assert counter["server_sessions"] == 32 and counter["mean_reward"] == 1.0
    assert copy["ok"] and copy["learner_steps"] >= 6, copy


@pytest.mark.timeout(600)
def test_exported_rows_aggregate_in_pypi_nemo_gym(subprocess_env):
    """``streamrl export --format nemo-gym`` rows through NeMo Gym's own aggregation: one
    group of 4 rollouts per prompt; the same rows without the ``_ng_*`` keys are refused."""
    res = subprocess.run(
        [sys.executable, "bench/nemo_gym_pypi.py", "--nemo-gym-python", PYTHON,
         "--prompts", "6", "--train-steps", "0"],
        cwd=ROOT, env=subprocess_env, capture_output=True, text=True, timeout=580,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-4000:]
    agg = json.loads(res.stdout)["counter"]["aggregate_metrics"]
    assert agg["status"] == 200 and agg["tasks"] == 6, agg
    assert agg["rollouts_per_task"] == [4] and agg["mean_reward"] == 1.0, agg
    assert agg["without_ng_keys_status"] == 500, agg  # "Duplicate ... rollout key (0, 0)"
