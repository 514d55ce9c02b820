"""The whole pipeline on a real three-master Redis Cluster, rq on a plain Redis beside it."""

from __future__ import annotations

from streamrl.config import RunConfig
from streamrl.envs import make_env
from streamrl.pipeline import LocalPipeline, task_ids
from streamrl.producer import Producer


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
