"""Re-verify stored trajectories with the current verifiers and report what changed.

Every Score carries its verifier's name and version. After a verifier changes (a bug fixed, a
leak closed), ``streamrl reverify`` scores the trajectories kept in the ``groups`` stream again
and reports, per (old version -> new version), how many rewards moved and by how much: the
drift a change in the reward definition causes, measured before anyone trains on it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import redis

from streamrl import schema
from streamrl.bus.shards import run_shards
from streamrl.envs import Environment, make_env
from streamrl.pipeline import xrange_all
from streamrl.workers.verify import VerifyFailure, verify_one


def drift_report(
    r: redis.Redis,
    run: str,
    start: str = "-",
    limit: int | None = None,
    timeout_s: float = 10.0,
    env_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    envs: dict[str, Environment] = {}
    rows: dict[tuple, dict[str, Any]] = defaultdict(
        lambda: {"samples": 0, "changed": 0, "failed": 0, "sum_delta": 0.0, "examples": []}
    )
    seen = 0
    rows_of = (row for k in run_shards(r, run) for row in xrange_all(r, k.groups))
    for eid, fields in rows_of:
        if start != "-" and eid.decode() < start:
            continue
        group = schema.GROUP.decode(fields[b"p"])
        for sample in group.samples:
            traj, old = sample.trajectory, sample.score
            env = envs.get(traj.env)
            if env is None:
                env = envs[traj.env] = make_env(traj.env, **(env_options or {}))
            name, version = env.verifier_id
            row = rows[(old.verifier, old.verifier_version, name, version)]
            row["samples"] += 1
            try:
                new = verify_one(env, traj, timeout_s, retries=0)
            except VerifyFailure as e:
                row["failed"] += 1
                row["examples"].append({"task_id": traj.task_id, "failure": str(e)})
                continue
            delta = (new.reward or 0.0) - (old.reward or 0.0)
            if abs(delta) > 1e-9:
                row["changed"] += 1
                row["sum_delta"] += delta
                if len(row["examples"]) < 5:
                    row["examples"].append(
                        {"task_id": traj.task_id, "old": old.reward, "new": new.reward}
                    )
            seen += 1
            if limit is not None and seen >= limit:
                break
        if limit is not None and seen >= limit:
            break
    report = []
    for (old_name, old_version, new_name, new_version), row in sorted(rows.items()):
        n = row["samples"]
        report.append(
            {
                "verifier": new_name,
                "from_version": f"{old_name}/{old_version}",
                "to_version": f"{new_name}/{new_version}",
                "samples": n,
                "changed": row["changed"],
                "failed": row["failed"],
                "mean_delta": round(row["sum_delta"] / n, 6) if n else 0.0,
                "examples": row["examples"],
            }
        )
    return {"run": run, "samples": sum(x["samples"] for x in report), "drift": report}
