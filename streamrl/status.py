"""What ``streamrl status`` shows: per stage the stream length, consumer-group lag and pending
count, dead letters, rq workers per queue, groups completed, the policy version, the
learner's progress, and per rollout worker the policy version it serves (``health``)."""

from __future__ import annotations

import time
from typing import Any

import redis

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import stage_groups
from streamrl.defaults import ROLLOUT_QUEUE, VERIFY_QUEUE
from streamrl.health import policy_health


def _s(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def _num(v: Any) -> Any:
    v = _s(v)
    try:
        return int(v)
    except (TypeError, ValueError):
        try:
            return float(v)
        except (TypeError, ValueError):
            return v


def stream_info(r: redis.Redis, stream: str) -> dict[str, Any]:
    info: dict[str, Any] = {"length": r.xlen(stream), "groups": {}}
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError:
        groups = []
    for g in groups:
        info["groups"][_s(g["name"])] = {
            "lag": g.get("lag"),
            "pending": g.get("pending"),
            "consumers": g.get("consumers"),
            "last_delivered": _s(g.get("last-delivered-id")),
        }
    return info


def producer_state(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """The producer's gate (producer.LearnerAdmission): ``state`` running, waiting or done;
    while waiting, ``reason``, ``message`` and ``since``; its figures. Empty: no producer."""
    out = {_s(k): _num(v) for k, v in r.hgetall(keys.producer_state).items()}
    if out.get("state") == "waiting" and isinstance(out.get("since"), float | int):
        out["waiting_s"] = round(max(0.0, time.time() - out["since"]), 1)
    return out


def collect(r: redis.Redis, run: str, control: redis.Redis | None = None) -> dict[str, Any]:
    """``r``: the run's data Redis; ``control``: rq's, when that is another server."""
    from streamrl.workers import leases

    keys = Keys(run)
    stats = {_s(k): _num(v) for k, v in r.hgetall(keys.stats).items()}
    learner = {_s(k): _num(v) for k, v in r.hgetall(keys.learner).items()}
    stages = {}
    for stream, _group in stage_groups(keys):
        stages[stream.rsplit(":", 1)[1]] = stream_info(r, stream)
    policy_version = None
    last = r.xrevrange(keys.policy, count=1)
    if last:
        policy_version = schema.POLICY_VERSION.decode(last[0][1][b"p"]).version
    rq_redis = r if control is None else control
    workers = {q: leases.queue_health(rq_redis, q) for q in (ROLLOUT_QUEUE, VERIFY_QUEUE)}
    return {
        "run": run,
        "stages": stages,
        "scored": r.xlen(keys.scored),
        "dead_letters": r.xlen(keys.dead),
        "groups_completed": stats.get("groups_completed", 0),
        "groups_dropped": stats.get("groups_dropped", 0),
        "trajectories": stats.get("trajectories", 0),
        "duplicates_ignored": stats.get("duplicates_ignored", 0),
        "policy_version": policy_version,
        "rq": workers,
        "learner": learner,
        "producer": producer_state(r, keys),
        "policy_health": policy_health(r, keys),
    }
