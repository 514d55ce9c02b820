"""A Redis that deletes keys under memory pressure is refused at every role's start.

With ``maxmemory`` reached, any ``maxmemory-policy`` but ``noeviction`` makes Redis delete
keys to make room: stream entries, episode sessions, half-assembled groups, consumer-group
state. Nothing would say so; samples would be lost, or redone and counted twice. (The
``volatile-*`` policies are no safer: sessions carry a TTL.) Managed and shared Redis often
default to ``allkeys-lru``; BullMQ and Sidekiq refuse or warn on it too. With ``noeviction``
a full Redis refuses writes (``OOM``) instead, which the roles see and wait on.

Every long-lived role (producer, learner, rollout and verifier workers) checks ``INFO memory``
of its data Redis (each master of a Redis Cluster) as it starts and stops with one line that
says why and how to fix it. ``--allow-eviction`` (``STREAMRL_ALLOW_EVICTION=1``) runs anyway,
with a warning at every start; ``streamrl status`` shows the policy either way.
"""

from __future__ import annotations

import os
from typing import Any

import redis
import structlog
from redis.exceptions import RedisClusterException

from streamrl.connection import is_cluster

ENV_ALLOW = "STREAMRL_ALLOW_EVICTION"
SAFE = "noeviction"
_log = structlog.get_logger("streamrl.eviction")


class EvictingRedis(RuntimeError):
    """The data Redis may delete keys under memory pressure (one-line reason and fix)."""


def allowed() -> bool:
    """Whether ``--allow-eviction`` / ``STREAMRL_ALLOW_EVICTION`` asks to run anyway."""
    return os.environ.get(ENV_ALLOW, "").strip().lower() not in ("", "0", "false", "no")


def policies(r: Any) -> dict[str, str]:
    """``maxmemory-policy`` per server: ``{"": policy}`` for a plain Redis, ``{"host:port":
    policy}`` per master of a Redis Cluster. Read from ``INFO memory``, which managed Redis
    serves even where ``CONFIG`` is renamed away."""
    if not is_cluster(r):
        return {"": str(r.info("memory").get("maxmemory_policy", "?"))}
    per_node = r.info("memory", target_nodes=redis.RedisCluster.PRIMARIES)
    if "maxmemory_policy" in per_node:  # one master answered for all
        return {"": str(per_node["maxmemory_policy"])}
    return {node: str(info.get("maxmemory_policy", "?")) for node, info in per_node.items()}


def problem(found: dict[str, str]) -> str | None:
    """What is wrong with these policies, as one line with the fix; None when all is well."""
    bad = {node: policy for node, policy in found.items() if policy != SAFE}
    if not bad:
        return None
    where = ", ".join(f"{node} has {policy}" if node else policy for node, policy in bad.items())
    return (
        f"Redis maxmemory-policy is not noeviction ({where}): when memory runs short Redis "
        "would delete a run's stream entries, sessions and groups, losing or doubling work "
        "without a trace. Fix: `CONFIG SET maxmemory-policy noeviction` on every server (and "
        f"in its redis.conf); to run anyway, pass --allow-eviction or set {ENV_ALLOW}=1"
    )


def check(r: Any, role: str) -> str | None:
    """Raise ``EvictingRedis`` when the data Redis may evict keys, unless allowed (then warn
    loudly and return the reason). A Redis that will not say (``INFO`` denied to this user)
    is let through with a warning."""
    try:
        found = policies(r)
    except (redis.ResponseError, RedisClusterException) as e:
        _log.warning("cannot read maxmemory-policy; not checked", role=role, error=str(e))
        return None
    reason = problem(found)
    if reason is None:
        return None
    if not allowed():
        raise EvictingRedis(reason)
    _log.warning(f"RUNNING ON AN EVICTING REDIS ({ENV_ALLOW} is set)", role=role, reason=reason)
    return reason
