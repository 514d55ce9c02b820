"""Trimming by MINID behind the slowest consumer group and a retention window (never MAXLEN:
an entry some group has not read, or still holds pending, is never dropped)."""

from __future__ import annotations

import time

import redis

from streamrl.bus.shards import run_shards
from streamrl.bus.streams import Scripts, stage_groups
from streamrl.defaults import DEAD_CONSUMER_IDLE_MS, RETENTION_MS


def trim_run(r: redis.Redis, run: str, retention_ms: int = RETENTION_MS) -> dict[str, int]:
    """Trim every stream of every shard of the run that this client may write (verify
    workers may write them all; a producer on its ACL user trims only its tasks)."""
    scripts = Scripts(r)
    now_ms = int(time.time() * 1000)
    out = {}
    for keys in run_shards(r, run):
        for stream in keys.data_streams:
            if stream == keys.policy:
                continue  # policy history is small and is what backends reload from
            try:
                out[stream] = scripts.trim(keys=[stream], args=[retention_ms, now_ms])
            except redis.exceptions.NoPermissionError:
                continue  # a role's ACL user (``streamrl acl``) may not write this stream
    return out


def forget_idle_consumers(r: redis.Redis, run: str, idle_ms: int = DEAD_CONSUMER_IDLE_MS) -> int:
    """Delete consumers that hold nothing and have not read for ``idle_ms``: every killed or
    replaced worker leaves one behind (its name is unique). Nothing is lost: a consumer with
    no pending entries owns nothing, and a live one that was only idle is re-created by its
    next XREADGROUP."""
    removed = 0
    pairs = [pair for keys in run_shards(r, run) for pair in stage_groups(keys)]
    for stream, group in pairs:
        try:
            consumers = r.xinfo_consumers(stream, group)
        except redis.ResponseError:
            continue
        for c in consumers:
            if c["pending"] == 0 and c.get("inactive", c["idle"]) > idle_ms:
                removed += r.xgroup_delconsumer(stream, group, c["name"]) == 0
    return removed
