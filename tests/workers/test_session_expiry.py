"""Sessions left by abandoned episodes expire (``rollout.session_ttl_s``), and the expiry loses
no task: the entry stays pending, and the next worker to claim it starts the episode afresh."""

from __future__ import annotations

from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig
from streamrl.defaults import ROLLOUT_GROUP
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.producer.produce import Producer
from tests.support.waiting import wait_for

TTL_S = 2
PROMPTS, K = 4, 4


def _sessions(p) -> list[bytes]:
    return list(p.r.scan_iter(match=p.keys.session("*"), count=1000))


def test_abandoned_sessions_expire_and_their_tasks_are_still_done(
    redis_url, subprocess_env, tmp_path
):
    cfg = RunConfig(
        run="expiry",
        env="counter",
        group_size=K,
        env_options={"steps": 3},  # 4 turns: sessions stay open for a while
        policy=PolicyConfig(latency_s=0.4),
        rollout=RolloutConfig(lease_seconds=60, session_ttl_s=TTL_S),
        # nothing reclaims the abandoned entries before their sessions are gone
        streams=StreamConfig(claim_idle_ms=6000, heartbeat_s=0.3),
    )
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        victim, _verifier = p.start_workers(rollout=1, verify=1)
        p.wait_ready(1, 1)
        victim_name = p.procs.procs[0][0]
        Producer(p.r, cfg.run).from_env(make_env("counter", steps=3), PROMPTS, K, seed=2)
        wait_for(lambda: len(_sessions(p)) == PROMPTS * K, "every episode to commit a turn")
        ttls = [p.r.ttl(k) for k in _sessions(p)]
        assert all(0 < t <= TTL_S for t in ttls), ttls
        p.procs.kill(victim)  # the episodes are abandoned mid-way
        victim.wait()
        wait_for(lambda: not _sessions(p), "the abandoned sessions to expire", timeout=30)
        # the tasks themselves are not lost: still pending in the consumer group
        assert p.r.xpending(p.keys.tasks, ROLLOUT_GROUP)["pending"] == PROMPTS * K
        p.start_workers(rollout=1, verify=0)
        p.wait_groups(PROMPTS, timeout=90)
        acc = p.account(task_ids("counter", 2, PROMPTS, K))
        trajs = p.trajectories()
    assert acc.lost == 0 and acc.duplicated == 0 and acc.groups == PROMPTS
    for t in trajs:
        # nothing to resume from: the new worker ran the episode from its first turn
        assert t.attempt == 1 and t.resumed_from_turn == -1, (t.attempt, t.resumed_from_turn)
        assert len(t.turns) == 4
        assert t.worker != victim_name and all(turn.worker == t.worker for turn in t.turns)
