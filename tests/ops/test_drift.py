"""Re-verifying stored trajectories with a changed verifier reports the drift."""

from __future__ import annotations

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig, RunConfig
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline
from streamrl.ops.drift import drift_report
from streamrl.producer.produce import Producer


def test_drift_report_sees_a_changed_verifier(redis_url, subprocess_env, tmp_path):
    cfg = RunConfig(run="drift", group_size=2, policy=PolicyConfig(wrong_rate=0.5))
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        p.start_workers(1, 1)
        Producer(p.r, "drift").from_env(make_env("counter"), 10, 2)
        p.wait_groups(10)
        same = drift_report(p.r, "drift")
        from_five = drift_report(p.r, "drift", start="5")
        newest = p.r.xrevrange(Keys("drift").groups, count=1)[0][0].decode()
        from_newest = drift_report(p.r, "drift", start=newest)
        # the same trajectories under a stricter verifier: tests.support.envs:StrictCounter
        strict = drift_report_with(p.r)
    (row,) = same["drift"]
    assert row["samples"] == 20 and row["changed"] == 0 and row["failed"] == 0
    # --from is an entry ID, compared as one: "5" (ms 5) is before every group, and the newest
    # group's own ID keeps just that group (compared as text, "5" sorted after them all)
    assert from_five["drift"][0]["samples"] == 20
    assert from_newest["drift"][0]["samples"] == 2
    assert row["from_version"] == row["to_version"] == "counter/1"
    (row,) = strict["drift"]
    assert row["to_version"] == "counter-strict/2" and row["from_version"] == "counter/1"
    assert row["changed"] > 0 and row["mean_delta"] < 0, row


def drift_report_with(r):
    """Point the stored trajectories' env name at a stricter verifier, as a new release of the
    environment would, and re-verify."""
    import streamrl.envs.registry as registry

    registry.BUILTIN["counter"], old = (
        "tests.support.envs:StrictCounter",
        registry.BUILTIN["counter"],
    )
    try:
        return drift_report(r, "drift")
    finally:
        registry.BUILTIN["counter"] = old
