"""The whole pipeline on a real three-master Redis Cluster, rq on a plain Redis beside it."""

from __future__ import annotations

from streamrl.config import RunConfig
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.producer.produce import Producer
from tests.support.waiting import wait_for


def test_pipeline_on_cluster(cluster_urls, subprocess_env, tmp_path):
    data_url, control_url = cluster_urls
    cfg = RunConfig(run="cl-e2e", env="counter", group_size=4, env_options={"steps": 2})
    with LocalPipeline(
        cfg, url=data_url, control_url=control_url, directory=tmp_path, worker_env=subprocess_env
    ) as p:
        p.start_workers(rollout=2, verify=1)
        res = Producer(p.r, cfg.run).from_env(make_env("counter", steps=2), 32, 4, seed=3)
        assert res.samples == 128
        p.wait_groups(32, settled=False)
        acc = p.account(task_ids("counter", 3, 32, 4))
        trajs = p.trajectories()
        # rq's keys are on the plain Redis, none of them on the cluster
        assert any(k.startswith(b"rq:") for k in p.control.keys("rq:*"))
        assert not list(p.r.scan_iter(match="rq:*"))
    assert acc.groups == 32 and acc.malformed_groups == 0
    assert acc.lost == 0 and acc.duplicated == 0 and acc.failures == 0
    assert all(len(t.turns) == 3 and t.status == "completed" for t in trajs)


def test_rollout_chaos_on_cluster(cluster_urls, subprocess_env, tmp_path):
    """A SIGKILLed rollout worker's episodes resume at their committed turn, on a cluster."""
    from tests.workers.test_chaos import killed_rollout_worker_resumes

    killed_rollout_worker_resumes(*cluster_urls, subprocess_env, tmp_path)


def test_cli_produce_status_and_replay_on_cluster(cluster_urls, subprocess_env, tmp_path):
    """The `streamrl` command with a cluster data URL and a plain control URL: produce, let
    workers score everything, then `replay verify --from 0` re-delivers every trajectory and
    the group scripts ignore each one as a duplicate (nothing doubled)."""
    import json

    from tests.support.cli import run_cli

    data_url, control_url = cluster_urls
    run = "cl-cli"
    base = ["--run-dir", str(tmp_path / "rd"), "--redis", data_url, "--run", run]
    alone = run_cli([*base, "status"], subprocess_env)
    assert alone.returncode == 1 and "--control-redis" in alone.stderr
    base += ["--control-redis", control_url]
    made = run_cli(
        [*base, "produce", "--env", "counter", "--count", "6", "--group-size", "2"],
        subprocess_env,
    )
    assert made.returncode == 0, made.stderr
    assert "pushed 6 prompts (12 samples)" in made.stdout
    cfg = RunConfig(run=run, env="counter", group_size=2)
    with LocalPipeline(
        cfg, url=data_url, control_url=control_url, directory=tmp_path, worker_env=subprocess_env
    ) as p:
        p.start_workers(rollout=1, verify=1)
        p.wait_groups(6, settled=False)
        shown = run_cli([*base, "status", "--json"], subprocess_env)
        assert shown.returncode == 0, shown.stderr
        info = json.loads(shown.stdout)
        assert info["groups_completed"] == 6 and info["trajectories"] == 12
        assert info["rq"]["srl-verify"]["workers"] == 1
        replayed = run_cli([*base, "replay", "verify", "--from", "0"], subprocess_env)
        assert replayed.returncode == 0, replayed.stderr
        replays = lambda: p.stat("duplicates_ignored") >= 12  # noqa: E731
        wait_for(replays, "the 12 replayed trajectories to be ignored", 60)
        assert p.stat("duplicates_ignored") == 12
        acc = p.account(task_ids("counter", 0, 6, 2))
    assert acc.groups == 6 and acc.lost == 0 and acc.duplicated == 0
