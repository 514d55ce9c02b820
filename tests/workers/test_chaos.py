"""SIGKILL workers while they hold work: nothing is lost, nothing is counted twice, and a
rollout episode is resumed at its committed turn by another worker, not restarted."""

from __future__ import annotations

from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.producer.produce import Producer
from tests.support.waiting import wait_for

FAST_RECLAIM = StreamConfig(claim_idle_ms=1500, heartbeat_s=0.3, max_deliveries=5)


def _sessions(p) -> int:
    return len(list(p.r.scan_iter(match=p.keys.session("*"), count=1000)))


def test_killed_rollout_worker_episodes_resume_at_committed_turn(
    redis_url, subprocess_env, tmp_path
):
    killed_rollout_worker_resumes(redis_url, None, subprocess_env, tmp_path)


def killed_rollout_worker_resumes(url, control_url, subprocess_env, tmp_path, **config) -> None:
    """The rollout chaos check on any Redis (``url``, rq on ``control_url`` when given)."""
    cfg = RunConfig(
        run="chaos-rollout",
        env="counter",
        group_size=4,
        env_options={"steps": 3},  # 4 turns per episode
        policy=PolicyConfig(latency_s=0.4),
        rollout=RolloutConfig(lease_seconds=60),
        streams=FAST_RECLAIM,
        **config,
    )
    with LocalPipeline(
        cfg, url=url, control_url=control_url, directory=tmp_path, worker_env=subprocess_env
    ) as p:
        victim, _verifier = p.start_workers(rollout=1, verify=1)
        p.wait_ready(1, 1)
        victim_name = p.procs.procs[0][0]
        Producer(p.r, cfg.run).from_env(make_env("counter", steps=3), 16, 4, seed=5)
        # wait until the victim holds episodes with committed turns, then kill it outright
        wait_for(lambda: _sessions(p) >= 64, "every episode to commit a turn", 30)
        assert _sessions(p) == 64
        p.procs.kill(victim)
        victim.wait()
        p.start_workers(rollout=1, verify=0)
        p.wait_groups(16, timeout=90)
        acc = p.account(task_ids("counter", 5, 16, 4))
        trajs = p.trajectories()
    assert acc.lost == 0 and acc.duplicated == 0 and acc.groups == 16
    assert acc.malformed_groups == 0
    for t in trajs:
        assert len(t.turns) == 4, "a resumed episode must not redo committed turns"
        assert t.resumed_from_turn >= 1 and t.attempt == 2
        done_by_victim = [turn.worker for turn in t.turns[: t.resumed_from_turn]]
        assert set(done_by_victim) == {victim_name}
        assert all(turn.worker != victim_name for turn in t.turns[t.resumed_from_turn :])
        assert t.worker != victim_name


def test_killed_verifier_loses_and_duplicates_nothing(redis_url, subprocess_env, tmp_path):
    cfg = RunConfig(
        run="chaos-verify",
        env="tests.support.envs:SlowVerifyCounter",
        env_options={"steps": 1, "verify_sleep_s": 0.03},
        group_size=4,
        verify=VerifyConfig(batch=16, lease_seconds=60),
        streams=FAST_RECLAIM,
    )
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        (_rollout, victim) = p.start_workers(rollout=1, verify=1)
        p.wait_ready(1, 1)
        env = make_env(cfg.env, **cfg.env_options)
        Producer(p.r, cfg.run).from_env(env, 40, 4, seed=6, env_spec=cfg.env)

        def holding() -> int:
            pending = p.r.xpending(p.keys.rollouts, "verify")["pending"]
            return pending if p.stat("scored") >= 20 else 0

        # kill it while it holds trajectories (on a loaded machine the verifier can be idle,
        # waiting for rollouts, at the moment 20 are scored)
        pending = wait_for(holding, "20 scored and trajectories held", 30, every=0.005)
        p.procs.kill(victim)
        victim.wait()
        assert 20 <= p.stat("scored") < 160 and pending > 0
        p.start_workers(rollout=0, verify=1)
        p.wait_groups(40, timeout=90)
        acc = p.account(task_ids(env.name, 6, 40, 4))
    assert acc.lost == 0 and acc.duplicated == 0
    assert acc.groups == 40 and acc.malformed_groups == 0
