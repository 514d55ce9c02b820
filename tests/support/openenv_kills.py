"""Rollout workers killed mid-episode against a real OpenEnv server (openenv-core's echo
template), and the figures that say whether every step was applied once: shared by
tests/workers/test_openenv_pipeline.py and bench/openenv_kills.py.

Each row asks the scripted policy to echo 1-4 words, one ``step`` each; the echo environment
rewards 0.1 a character, so every sample's right reward is known. The server's own count of
the steps it applied in the session that finished an episode (``state.step_count``, read after
each step) says whether a step was applied twice there."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import msgspec

from streamrl import schema
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.envs._failpoints import DIR_ENV, ENV, P_ENV, SEED_ENV
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.producer.produce import Producer
from streamrl.schema import FunctionCall

WORDS = ["alpha", "be", "gamma", "delta", "ep", "zeta", "eta", "theta", "iota", "kappa"]
GROUP = 4


def write_rows(path: Path, prompts: int, seed: int = 0) -> list[float]:
    """Rows whose reference agent echoes 1-4 words; each row's right reward."""
    rng = random.Random(seed)
    expected = []
    with open(path, "w") as f:
        for i in range(prompts):
            words = rng.sample(WORDS, rng.randint(1, 4))
            row = {
                "id": f"echo-{i}",
                "prompt": "Echo these words, one per step: " + " ".join(words),
                "reference_actions": [{"message": w} for w in words],
            }
            f.write(json.dumps(row) + "\n")
            expected.append(sum(len(w) * 0.1 for w in words))
    return expected


def config(run: str, url: str) -> RunConfig:
    return RunConfig(
        run=run,
        env="openenv",
        group_size=GROUP,
        env_options={"base_url": url, "retries": 1, "connect_timeout_s": 2.0},
        policy=PolicyConfig(wrong_rate=0.0, latency_s=0.02),
        rollout=RolloutConfig(lease_seconds=30, max_concurrent=8),
        verify=VerifyConfig(retries=1, timeout_s=30),
        streams=StreamConfig(claim_idle_ms=1500, heartbeat_s=0.3, max_deliveries=30),
    )


def kill_run(
    server_url: str,
    redis_url: str,
    worker_env: dict[str, str],
    directory: Path,
    *,
    run: str,
    prompts: int = 8,
    faults: str = "after_open:1,after_tool_send:3",
    p: float = 1.0,
    seed: int = 0,
    timeout_s: float = 240.0,
) -> dict[str, Any]:
    """One run of ``prompts`` x 4 samples under the fault points; its figures."""
    fault_dir = directory / "faults"
    fault_dir.mkdir(parents=True)
    env = {**worker_env, ENV: faults, DIR_ENV: str(fault_dir), P_ENV: str(p), SEED_ENV: str(seed)}
    expected = write_rows(directory / "rows.jsonl", prompts, seed)
    cfg = config(run, server_url)
    drained = True
    with LocalPipeline(cfg, url=redis_url, directory=directory / "run", worker_env=env) as pipe:
        Producer(pipe.r, run).from_jsonl(directory / "rows.jsonl", "openenv", GROUP)
        pipe.start_workers(rollout=1, verify=1)
        try:
            pipe.wait_groups(prompts, timeout=timeout_s)
        except TimeoutError:
            drained = False
        ids = {f"echo-{i}:{k}" for i in range(prompts) for k in range(GROUP)}
        acc = pipe.account(ids)
        groups = [schema.GROUP.decode(f[b"p"]) for _, f in xrange_all(pipe.r, pipe.keys.groups)]
        dead = [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(pipe.r, pipe.keys.dead)]
    # each kill's site: "<point> <task_id>/<session attempt>/<steps applied>/<call_id>"
    sites = sorted(" ".join(x.read_text().split()) for x in fault_dir.iterdir())
    figures: dict[str, Any] = {
        "prompts": prompts,
        "samples": prompts * GROUP,
        "drained": drained,
        "kills": sites,
        "scored": acc.scored,
        "scored_twice": acc.duplicated,
        "lost": acc.lost,
        "failures": acc.failures,
        "dead_letters": len(dead),
        "steps": 0,
        "steps_applied_twice": 0,
        "steps_not_applied": 0,
        "rewards_wrong": 0,
        "samples_finished_in_a_fresh_session": 0,
        "steps_replayed_into_fresh_sessions_at_least": 0,
        "seed": seed,
    }
    rewards = []
    for g in groups:
        for s in g.samples:
            state = msgspec.msgpack.decode(s.trajectory.state)
            steps = sum(isinstance(i, FunctionCall) for i in s.trajectory.items)
            applied = int(state.get("server_state", {}).get("step_count", 0))
            figures["steps"] += steps
            figures["steps_applied_twice"] += max(0, applied - steps)
            figures["steps_not_applied"] += max(0, steps - applied)
            i = int(s.score.prompt_id.split("-")[1])
            figures["rewards_wrong"] += abs((s.score.reward or 0.0) - expected[i]) > 1e-9
            fresh = state.get("journal", {}).get("attempt", 0) >= 1
            figures["samples_finished_in_a_fresh_session"] += fresh
            rewards.append(s.score.reward)
    # a kill after step n of a session (n confirmed before it) makes n steps be replayed
    figures["steps_replayed_into_fresh_sessions_at_least"] = sum(
        int(site.split()[1].split("/")[2]) for site in sites if site.startswith("after_tool_send")
    )
    figures["mean_reward"] = round(sum(rewards) / len(rewards), 4) if rewards else None
    return figures
