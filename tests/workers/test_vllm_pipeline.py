"""Real rollout worker processes sample through the real vLLM server (the ``vllm`` fixture):
two workers share it, episodes carry vLLM's token ids, log-probs and the version that
produced them, the server follows the learner's versions, and a version it cannot load shows
in policy health while it keeps serving the last good one."""

from __future__ import annotations

import time

import pytest

from streamrl.bus import health
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig
from streamrl.defaults import MAX_CONCURRENT_EPISODES as MAX_CONCURRENT
from streamrl.defaults import POLICY_URL_ENV
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.producer.produce import Producer
from tests.support.vllm import SAME, Reference, announce, new_version

pytestmark = pytest.mark.timeout(1200)


def vllm_run(run: str, url: str, max_new_tokens: int = 12, concurrent: int = 0,
             **options) -> RunConfig:  # fmt: skip
    return RunConfig(
        run=run,
        env="copy",
        group_size=2,
        policy=PolicyConfig(
            backend="openai",
            base_url=url + "/v1",
            model="policy",
            temperature=0.8,
            max_new_tokens=max_new_tokens,
            options={"trust_env": False, "reload_check_s": 0.5, "backoff_s": 0.5, **options},
        ),
        rollout=RolloutConfig(max_policy_lag_s=0, max_concurrent=concurrent or MAX_CONCURRENT),
        streams=StreamConfig(heartbeat_s=1.0),
    )


def test_rollout_workers_sample_through_vllm_and_follow_versions(
    vllm, redis_url, subprocess_env, tmp_path, run_name
):
    cfg = vllm_run(run_name, vllm.url, sync="weights")
    env = make_env("copy")
    v1 = new_version(vllm.model_dir, tmp_path / "v1", 0.5)
    with LocalPipeline(
        cfg, url=redis_url, directory=tmp_path / "run", worker_env=subprocess_env
    ) as p:
        p.start_workers(rollout=2, verify=1)
        Producer(p.r, run_name).from_env(env, 3, 2, seed=1)
        p.wait_groups(3, timeout=600)
        announce(p.r, run_name, 1, v1)
        deadline = time.monotonic() + 120
        while vllm.weight_label() != "1" and time.monotonic() < deadline:
            time.sleep(0.5)
        assert vllm.weight_label() == "1"
        Producer(p.r, run_name).from_env(env, 6, 2, seed=1)  # prompts 3..5
        p.wait_groups(6, timeout=600)
        # a version the server cannot load: the error is in policy health, v1 keeps serving
        announce(p.r, run_name, 2, tmp_path / "no-such-version")
        deadline = time.monotonic() + 120
        errors: dict = {}
        while not errors and time.monotonic() < deadline:
            time.sleep(0.5)
            workers = health.policy_health(p.r, p.keys)["workers"]
            errors = {w: s for w, s in workers.items() if s["error"]}
        acc = p.account(task_ids("copy", 1, 6, 2))
        trajs = p.trajectories()
    assert errors, "the failed load never showed in policy health"
    assert all(s["version"] == 1 and s["newest"] == 2 for s in errors.values()), errors
    assert any("no-such-version" in s["error"] for s in errors.values()), errors
    assert vllm.weight_label() == "1"
    assert acc.lost == acc.duplicated == acc.failures == 0 and acc.groups == 6
    ref = Reference()
    dirs = {0: vllm.model_dir, 1: v1}
    versions = []
    for t in trajs:
        assert t.status == "completed" and len(t.turns) == 1
        turn = t.turns[0]
        assert turn.prompt_token_ids and len(turn.token_ids) == len(turn.logprobs) > 0
        versions.append(turn.policy_version)
        assert ref.error(dirs[turn.policy_version], turn) < SAME, turn.policy_version
    assert 0 in versions and 1 in versions


def test_vllm_killed_mid_run_episodes_wait_and_resume(
    vllm, redis_url, subprocess_env, tmp_path, run_name
):
    """SIGKILL of the whole server (API process, engine, worker) while episodes are running:
    the workers' requests fail, back off and wait for the server; once it is restarted every
    episode completes. Nothing is scored 0 or failed and nothing is dead-lettered."""
    if vllm.server is None:
        pytest.skip("needs the server process this session started")
    # long enough turns (no early end-of-turn) that the kill lands while requests are running
    cfg = vllm_run(run_name, vllm.url, 48, down_wait_s=600, extra_body={"ignore_eos": True})
    env = make_env("copy")
    run_dir = tmp_path / "run"
    with LocalPipeline(cfg, url=redis_url, directory=run_dir, worker_env=subprocess_env) as p:
        p.start_workers(rollout=2, verify=1)
        Producer(p.r, run_name).from_env(env, 6, 2, seed=2)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not vllm.running_requests():
            time.sleep(0.1)
        running_at_kill = vllm.running_requests()
        vllm.server.kill()
        done_at_kill = p.stat("groups_completed")
        time.sleep(3.0)  # requests now fail against a closed port
        vllm.server.restart().wait_ready()
        p.wait_groups(6, timeout=600)
        acc = p.account(task_ids("copy", 2, 6, 2))
        trajs = p.trajectories()
        dead = p.r.xlen(p.keys.dead)
    assert done_at_kill < 6, "every episode finished before the kill: nothing was tested"
    assert running_at_kill > 0
    assert acc.lost == acc.duplicated == acc.failures == 0 and acc.groups == 6
    assert dead == 0
    assert all(t.status == "completed" and t.turns[0].token_ids for t in trajs)


def test_two_servers_two_pools_both_follow_the_learner(
    vllm2, vllm, redis_url, subprocess_env, tmp_path, run_name
):
    """Two vLLM servers, one pool of rollout workers on each (the run's ``base_url`` and one
    pinned with ``STREAMRL_POLICY_BASE_URL``): a version the learner announces is loaded by
    both servers, and every turn is stamped with the version of the server that produced it
    (its log-probs are those of that version's weights)."""
    cfg = vllm_run(run_name, vllm.url, concurrent=1, sync="weights")
    env = make_env("copy")
    v1 = new_version(vllm.model_dir, tmp_path / "v1", 0.5)
    started = time.monotonic()
    with LocalPipeline(
        cfg, url=redis_url, directory=tmp_path / "run", worker_env=subprocess_env
    ) as p:
        p.start_workers(rollout=1, verify=1)
        p.start_workers(rollout=1, verify=0, env={POLICY_URL_ENV: vllm2.url + "/v1"})
        Producer(p.r, run_name).from_env(env, 4, 2, seed=4)
        p.wait_groups(4, timeout=600)
        announce(p.r, run_name, 1, v1)
        deadline = time.monotonic() + 120
        while {vllm.weight_label(), vllm2.weight_label()} != {"1"} and time.monotonic() < deadline:
            time.sleep(0.5)
        labels = vllm.weight_label(), vllm2.weight_label()
        Producer(p.r, run_name).from_env(env, 8, 2, seed=4)  # prompts 4..7
        p.wait_groups(8, timeout=600)
        server_of = {
            w: s["server"] for w, s in health.policy_health(p.r, p.keys)["workers"].items()
        }
        acc = p.account(task_ids("copy", 4, 8, 2))
        trajs = p.trajectories()
    print(f"two servers, two pools: {time.monotonic() - started:.1f} s")
    assert labels == ("1", "1"), labels
    assert sorted(server_of.values()) == sorted([vllm.url, vllm2.url]), server_of
    assert acc.lost == acc.duplicated == acc.failures == 0 and acc.groups == 8
    ref = Reference()
    dirs = {0: vllm.model_dir, 1: v1}
    seen = set()
    for t in trajs:
        turn = t.turns[0]
        assert ref.error(dirs[turn.policy_version], turn) < SAME, (t.worker, turn.policy_version)
        seen.add((server_of[t.worker], turn.policy_version))
    assert {(vllm.url, 1), (vllm2.url, 1)} <= seen, seen
