"""`streamrl status` reports what a person needs: per-stage lag and pending, dead letters,
workers, groups, policy version, and a lease that keeps failing."""

from __future__ import annotations

from streamrl import schema
from streamrl.config import PolicyConfig, RunConfig
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline
from streamrl.ops.status import collect
from streamrl.producer.produce import Producer
from tests.support.waiting import wait_for


def test_status_counts_and_failed_leases(redis_url, subprocess_env, tmp_path):
    cfg = RunConfig(run="st", group_size=2, policy=PolicyConfig(backend="no-such-backend"))
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        Producer(p.r, "st").from_env(make_env("counter"), 5, 2)
        p.r.xadd(p.keys.policy, {"p": schema.encode(schema.PolicyVersion(version=7))})
        p.start_workers(rollout=1, verify=0)

        def failed_lease() -> dict | None:
            info = collect(p.r, "st")
            return info if info["rq"]["srl-rollout"]["failed_leases"] else None

        info = wait_for(failed_lease, "a failed rollout lease", 60, every=0.2)
    rollout = info["rq"]["srl-rollout"]
    assert rollout["workers"] == 1
    # a config that slipped past the CLI's checks is refused where the worker decodes it
    assert "Invalid enum value 'no-such-backend' - at `$.policy.backend`" in rollout["last_failure"]
    assert info["stages"]["tasks"]["length"] == 10
    assert info["stages"]["tasks"]["groups"]["rollout"]["lag"] == 10
    assert info["policy_version"] == 7
    assert info["groups_completed"] == 0
