"""Trimming by MINID behind the slowest consumer group and a retention window (never MAXLEN:
an entry some group has not read, or still holds pending, is never dropped)."""

from __future__ import annotations

import time

import redis

from streamrl.bus.keys import Keys
from streamrl.bus.streams import Scripts
from streamrl.defaults import RETENTION_MS


def trim_run(r: redis.Redis, run: str, retention_ms: int = RETENTION_MS) -> dict[str, int]:
    keys = Keys(run)
    scripts = Scripts(r)
    now_ms = int(time.time() * 1000)
    out = {}
    for stream in keys.data_streams:
        if stream == keys.policy:
            continue  # policy history is small and is what backends reload from
        out[stream] = scripts.trim(keys=[stream], args=[retention_ms, now_ms])
    return out
