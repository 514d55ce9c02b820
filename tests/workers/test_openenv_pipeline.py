"""A real OpenEnv server (the echo environment ``openenv init`` writes from openenv-core's own
template, unchanged: one session at a time; served by the package in a process of its own,
the ``openenv_server`` fixture) through real rq workers.

Rollout work horses SIGKILL themselves inside the windows that matter (a session's reset
answered and not yet checkpointed; a step applied and answered and not yet checkpointed: the
fault points of ``streamrl.envs._failpoints``): the episodes go on in fresh sessions with the
confirmed steps replayed, and the server's own count of the steps it applied in the session
that finished each episode (``state.step_count``) equals the episode's steps: none applied
twice, none scored from a repeat. A server that is down dead-letters its samples: never a 0."""

from __future__ import annotations

import json
import os
import random

import msgspec
import pytest

from streamrl import schema
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.envs._failpoints import DIR_ENV, ENV, P_ENV, SEED_ENV
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.producer.produce import Producer
from streamrl.schema import FunctionCall
from tests.support.openenv_server import free_port

WORDS = ["alpha", "be", "gamma", "delta", "ep", "zeta", "eta", "theta", "iota", "kappa"]
PROMPTS = 8


def _rows(path, seed: int = 0) -> list[float]:
    """Rows whose reference agent echoes 1-4 words; returns each row's expected reward."""
    rng = random.Random(seed)
    expected = []
    with open(path, "w") as f:
        for i in range(PROMPTS):
            words = rng.sample(WORDS, rng.randint(1, 4))
            row = {
                "id": f"echo-{i}",
                "prompt": "Echo these words, one per step: " + " ".join(words),
                "reference_actions": [{"message": w} for w in words],
            }
            f.write(json.dumps(row) + "\n")
            expected.append(sum(len(w) * 0.1 for w in words))
    return expected


def _config(run: str, url: str) -> RunConfig:
    return RunConfig(
        run=run,
        env="openenv",
        group_size=4,
        env_options={"base_url": url, "retries": 1, "connect_timeout_s": 2.0},
        policy=PolicyConfig(wrong_rate=0.0, latency_s=0.02),
        rollout=RolloutConfig(lease_seconds=30, max_concurrent=8),
        verify=VerifyConfig(retries=1, timeout_s=30),
        streams=StreamConfig(claim_idle_ms=1500, heartbeat_s=0.3, max_deliveries=30),
    )


def _kill_run(server, redis_url, worker_env, tmp_path, run: str, **faults: str) -> tuple:
    """One run of PROMPTS x 4 under the fault points; (kill sites, samples, accounting,
    dead letters, expected rewards)."""
    fault_dir = tmp_path / "faults"
    fault_dir.mkdir()
    env = {**worker_env, DIR_ENV: str(fault_dir), **faults}
    expected = _rows(tmp_path / "rows.jsonl")
    cfg = _config(run, server.url)
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path / "run", worker_env=env) as p:
        Producer(p.r, cfg.run).from_jsonl(tmp_path / "rows.jsonl", "openenv", 4)
        p.start_workers(rollout=1, verify=1)
        p.wait_groups(PROMPTS, timeout=240)
        acc = p.account({f"echo-{i}:{k}" for i in range(PROMPTS) for k in range(4)})
        groups = [schema.GROUP.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.groups)]
        dead = list(xrange_all(p.r, p.keys.dead))
    # each kill's site: "<point> <task_id>/<session attempt>/<steps applied>/<call_id>"
    sites = sorted(x.read_text().split() for x in fault_dir.iterdir())
    return sites, [s for g in groups for s in g.samples], acc, dead, expected


def _check_each_step_once(samples, acc, dead, expected, why: str) -> int:
    """Every sample scored once, right, from a session that applied each step once; returns
    how many samples finished in a fresh session."""
    assert acc.lost == acc.duplicated == acc.failures == 0 and acc.groups == PROMPTS, why
    assert not dead, why
    replayed = 0
    for s in samples:
        state = msgspec.msgpack.decode(s.trajectory.state)
        steps = [i for i in s.trajectory.items if isinstance(i, FunctionCall)]
        # the server applied each of the episode's steps once in the session that finished it
        assert state["server_state"]["step_count"] == len(steps), (s.score.task_id, state, why)
        assert len(state["rewards"]) == len(steps), (s.score.task_id, state, why)
        i = int(s.score.prompt_id.split("-")[1])
        assert s.score.reward == pytest.approx(expected[i]), (s.score.task_id, why)
        assert s.score.info["server_state"] == state["server_state"]
        replayed += state["journal"].get("attempt", 0) >= 1
    return replayed


@pytest.mark.timeout(400)
def test_kills_after_a_reset_and_after_steps_apply_each_step_once(
    openenv_server, redis_url, subprocess_env, tmp_path
):
    faults = {ENV: "after_open:1,after_tool_send:3"}
    sites, samples, acc, dead, expected = _kill_run(
        openenv_server, redis_url, subprocess_env, tmp_path, "openenv-kills", **faults
    )
    why = f"kills {sites}; logs in {tmp_path}"
    assert [s[0] for s in sites].count("after_open") == 1, why
    assert [s[0] for s in sites].count("after_tool_send") == 3, why
    replayed = _check_each_step_once(samples, acc, dead, expected, why)
    assert replayed >= 3, why  # the killed episodes went on in fresh sessions


@pytest.mark.timeout(400)
def test_seeded_random_kills_replay_confirmed_steps_once(
    openenv_server, redis_url, subprocess_env, tmp_path
):
    seed = int(os.environ.get("STREAMRL_KILL_SEED") or random.randrange(1 << 30))
    faults = {ENV: "*:4", P_ENV: "0.12", SEED_ENV: str(seed)}
    sites, samples, acc, dead, expected = _kill_run(
        openenv_server, redis_url, subprocess_env, tmp_path, "openenv-random", **faults
    )
    why = f"seed {seed} (rerun with STREAMRL_KILL_SEED={seed}); kills {sites}; logs in {tmp_path}"
    assert sites, why
    _check_each_step_once(samples, acc, dead, expected, why)


@pytest.mark.timeout(300)
def test_a_server_that_is_down_dead_letters_and_never_scores(redis_url, subprocess_env, tmp_path):
    _rows(tmp_path / "rows.jsonl")
    cfg = _config("openenv-down", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    cfg.group_size = 2
    with LocalPipeline(
        cfg, url=redis_url, directory=tmp_path / "run", worker_env=subprocess_env
    ) as p:
        Producer(p.r, cfg.run).from_jsonl(tmp_path / "rows.jsonl", "openenv", 2)
        p.start_workers(rollout=1, verify=1)
        p.wait_groups(PROMPTS, timeout=180)
        scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]
        dead = [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.dead)]
        completed, dropped = p.stat("groups_completed"), p.stat("groups_dropped")
    assert completed == 0 and dropped == PROMPTS
    assert all(s.reward is None for s in scores) and len(dead) == PROMPTS * 2
    assert all("openenv" in d.reason for d in dead), dead[0].reason
