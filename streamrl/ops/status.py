"""What ``streamrl status`` shows: per stage the stream length, consumer-group lag and pending
count, dead letters, rq workers per queue, groups completed, the policy version, the
learner's progress, per rollout worker the policy version it serves (``health``), and the
data Redis itself: its ``maxmemory-policy`` and, on a Redis Cluster, which master serves the
run's own keys and each shard (``redis``)."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import redis

from streamrl import schema
from streamrl.bus import eviction
from streamrl.bus.health import policy_health
from streamrl.bus.keys import Keys
from streamrl.bus.shards import run_shards
from streamrl.bus.streams import stage_groups
from streamrl.bus.values import as_str
from streamrl.connection import is_cluster
from streamrl.defaults import MASKED, ROLLOUT_QUEUE, VERIFY_QUEUE
from streamrl.producer import mixture

_DEAD_SCAN = 10_000  # dead letters read per shard to count them by environment


class _EnvOf(msgspec.Struct):
    """The ``env`` of a dead letter's payload (a Task or a Trajectory), whatever else it holds."""

    env: str = ""


_ENV_OF = msgspec.msgpack.Decoder(_EnvOf)


def env_of_dead_letter(dl: schema.DeadLetter) -> str:
    """The environment of a dead letter's sample; "unknown" for a dataset row or bad bytes."""
    try:
        return _ENV_OF.decode(dl.payload).env or "unknown"
    except (msgspec.DecodeError, msgspec.ValidationError):
        return "unknown"


def dead_letters_by_env(r: redis.Redis, shards: list[Keys]) -> dict[str, int]:
    """Dead letters by environment, over the newest ``_DEAD_SCAN`` of each shard."""
    out: dict[str, int] = {}
    for k in shards:
        for _eid, fields in r.xrevrange(k.dead, count=_DEAD_SCAN):
            try:
                env = env_of_dead_letter(schema.DEAD_LETTER.decode(fields[b"p"]))
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                env = "unknown"
            out[env] = out.get(env, 0) + 1
    return out


def mixture_status(r: redis.Redis, run: str, shards: list[Keys], learner: dict) -> dict | None:
    """The run's mixture (None without one): per environment its weight and share, whether
    it is paused (and why) or removed, the last tripwire that fired, and the learner's
    figures for it with its dead letters."""
    mix = mixture.load(r, run)
    if mix is None:
        return None
    held = mixture.paused(r, run)
    tripped = {as_str(k): as_str(v) for k, v in r.hgetall(Keys(run).tripped).items()}
    try:
        figures = msgspec.json.decode(learner.get("per_env") or "{}", type=dict[str, dict])
    except msgspec.DecodeError:
        figures = {}
    dead = dead_letters_by_env(r, shards)
    rows = mixture.describe(mix, held)
    for row in rows:
        row.update(figures.get(row["name"], {}))
        row["dead_letters"] = dead.get(row["name"], 0)
        row["tripped"] = tripped.get(row["name"], "")
    return {"version": mix.version, "envs": rows}


def _num(v: Any) -> Any:
    v = None if v is None else as_str(v)
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
        info["groups"][as_str(g["name"])] = {
            "lag": g.get("lag"),
            "pending": g.get("pending"),
            "consumers": g.get("consumers"),
            "last_delivered": as_str(g.get("last-delivered-id")),
        }
    return info


def _producer_state(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """The producer's gate (producer.LearnerAdmission): ``state`` running, waiting or done;
    while waiting, ``reason``, ``message`` and ``since``; its figures. Empty: no producer."""
    out = {as_str(k): _num(v) for k, v in r.hgetall(keys.producer_state).items()}
    if out.get("state") == "waiting" and isinstance(out.get("since"), float | int):
        out["waiting_s"] = round(max(0.0, time.time() - out["since"]), 1)
    return out


_COUNTERS = ("groups_completed", "groups_dropped", "trajectories", "duplicates_ignored")


def _shard_status(r: redis.Redis, keys: Keys) -> dict[str, Any]:
    """Streams and counters of one shard (of the whole run when unsharded)."""
    stats = {as_str(k): _num(v) for k, v in r.hgetall(keys.stats).items()}
    stages = {}
    for stream, _group in stage_groups(keys):
        stages[stream.rsplit(":", 1)[1]] = stream_info(r, stream)
    return {
        "stages": stages,
        "scored": r.xlen(keys.scored),
        "dead_letters": r.xlen(keys.dead),
        **{name: stats.get(name, 0) for name in _COUNTERS},
        # samples whose score the environment masked, by its failure_kind (dead letters too)
        "masked": {k[len(MASKED) :]: v for k, v in sorted(stats.items()) if k.startswith(MASKED)},
    }


def _sum_or_none(values: list[Any]) -> Any:
    return None if any(v is None for v in values) else sum(values)


def _total(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards of a run added up: lengths, lag, pending and counters are summed; a lag
    that Redis cannot tell on one shard (None) is unknown in total; consumers are the most
    any shard has (the same worker consumes every shard)."""
    out: dict[str, Any] = {"stages": {}}
    for stage in parts[0]["stages"]:
        rows = [p["stages"][stage] for p in parts]
        groups: dict[str, Any] = {}
        for name in {g for row in rows for g in row["groups"]}:
            gs = [row["groups"].get(name, {}) for row in rows]
            groups[name] = {
                "lag": _sum_or_none([g.get("lag") for g in gs]),
                "pending": sum(g.get("pending") or 0 for g in gs),
                "consumers": max(g.get("consumers") or 0 for g in gs),
                "last_delivered": None,  # an entry id means nothing across shards
            }
        out["stages"][stage] = {"length": sum(row["length"] for row in rows), "groups": groups}
    for name in ("scored", "dead_letters", *_COUNTERS):
        out[name] = sum(p[name] for p in parts)
    masked: dict[str, int] = {}
    for p in parts:
        for kind, n in p["masked"].items():
            masked[kind] = masked.get(kind, 0) + n
    out["masked"] = dict(sorted(masked.items()))
    return out


def node_of(r: Any, key: str) -> str | None:
    """``host:port`` of the Redis Cluster master serving ``key`` (None on a plain Redis)."""
    return r.get_node_from_key(key).name if is_cluster(r) else None


def _redis_status(r: Any, keys: Keys) -> dict[str, Any]:
    try:
        policies = eviction.policies(r)
    except redis.ResponseError as e:  # INFO denied to this user
        policies, problem = {}, f"cannot read maxmemory-policy: {e}"
    else:
        problem = eviction.problem(policies)
    return {
        "cluster": is_cluster(r),
        "node": node_of(r, keys.config),  # the run's own keys (all of them when unsharded)
        "maxmemory_policy": policies,
        "eviction": problem,
        "full": _full(r),
    }


def _full(r: Any) -> str | None:
    """Why Redis refuses writes now (``used_memory`` at ``maxmemory``), or None."""
    try:
        info = r.info("memory")
    except redis.RedisError:
        return None
    nodes = {"": info} if "used_memory" in info else info  # a cluster: per node
    for node, mem in nodes.items():
        used, limit = int(mem.get("used_memory", 0)), int(mem.get("maxmemory", 0))
        if limit and used >= limit:
            where = f" on {node}" if node else ""
            return (
                f"Redis is full{where}: used_memory {used / 2**20:.1f} MiB >= maxmemory "
                f"{limit / 2**20:.1f} MiB; writes are refused (OOM) and every role backs off "
                "until memory frees (trimming, the learner catching up) or maxmemory is raised"
            )
    return None


def collect(r: redis.Redis, run: str, control: redis.Redis | None = None) -> dict[str, Any]:
    """``r``: the run's data Redis; ``control``: rq's, when that is another server. A sharded
    run shows its totals in the usual fields and each shard under ``shards``."""
    from streamrl.workers import leases

    keys = Keys(run)
    shards = run_shards(r, run)
    parts = [_shard_status(r, k) for k in shards]
    learner = {as_str(k): _num(v) for k, v in r.hgetall(keys.learner).items()}
    policy_version = None
    last = r.xrevrange(keys.policy, count=1)
    if last:
        policy_version = schema.POLICY_VERSION.decode(last[0][1][b"p"]).version
    rq_redis = r if control is None else control
    workers = {q: leases.queue_health(rq_redis, q) for q in (ROLLOUT_QUEUE, VERIFY_QUEUE)}
    info = {
        "run": run,
        **(parts[0] if len(parts) == 1 else _total(parts)),
        "policy_version": policy_version,
        "rq": workers,
        "learner": learner,
        "producer": _producer_state(r, keys),
        "policy_health": policy_health(r, keys),
        "redis": _redis_status(r, keys),
    }
    mix = mixture_status(r, run, shards, learner)
    if mix is not None:
        info["mixture"] = mix
    judge = {as_str(k): int(v) for k, v in r.hgetall(keys.judge_stats).items()}
    if judge:  # the run's LLM judge (verifiers.judge): samples judged, calls, cache hits, ...
        info["judge"] = judge
    if len(parts) > 1:
        info["shards"] = {
            k.label: {"node": node_of(r, k.tasks), **part}
            for k, part in zip(shards, parts, strict=True)
        }
    return info
