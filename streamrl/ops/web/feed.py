"""The live page's reward feed: mean reward by policy version and samples scored per second,
folded from the ``scored`` stream of every shard in bounded reads.

``streamrl watch`` reads the whole ``scored`` stream from its start; a page that must open
fast on a run with millions of entries cannot. This feed starts from the newest ``backfill``
entries of each shard (``XREVRANGE ... COUNT``) and then follows new ones (``XRANGE`` from
the last ID it saw, at most ``pages`` pages of ``page`` entries a poll), so no call reads more
than a bounded number of entries and a feed that fell behind catches up over a few polls.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import msgspec
import redis

from streamrl import schema
from streamrl.bus.shards import run_shards
from streamrl.bus.values import as_str, id_order

BACKFILL = 5000  # scored entries per shard read when the feed opens
PAGE = 2000
PAGES_PER_POLL = 5
RATE_WINDOW_S = 60.0


class RewardFeed:
    """Per policy version: samples, reward sum, failures; and the entry times of the recent
    ones for the scoring rate. Thread-safe: one feed serves every open page."""

    def __init__(self, run: str, backfill: int = BACKFILL):
        self.run = run
        self.backfill = backfill
        self.last: dict[str, str] = {}  # scored stream -> last entry ID folded
        self.by_version: dict[int, list[float]] = {}  # version -> [samples, reward sum]
        self.failures = 0
        self.undecodable = 0
        self.times: deque[float] = deque(maxlen=50_000)  # entry times (s) of recent samples
        self.lock = threading.Lock()

    def poll(self, r: redis.Redis) -> None:
        """Fold what was scored since the last poll (a Redis error propagates: the caller
        shows it and polls again later, from where this one stopped)."""
        with self.lock:
            for keys in run_shards(r, self.run):
                stream = keys.scored
                if stream not in self.last:
                    rows = r.xrevrange(stream, count=self.backfill)
                    self.last[stream] = as_str(rows[0][0]) if rows else "0-0"
                    self._fold(reversed(rows))
                    continue
                for _ in range(PAGES_PER_POLL):
                    rows = r.xrange(stream, min=f"({self.last[stream]}", count=PAGE)
                    if not rows:
                        break
                    self.last[stream] = as_str(rows[-1][0])
                    self._fold(rows)

    def _fold(self, rows: Any) -> None:
        for eid, fields in rows:
            try:
                score = schema.SCORE.decode(fields[b"p"])
            except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
                self.undecodable += 1
                continue
            if score.reward is None:
                self.failures += 1
                continue
            v = max(score.policy_versions) if score.policy_versions else 0
            row = self.by_version.setdefault(v, [0, 0.0])
            row[0] += 1
            row[1] += score.reward
            self.times.append(id_order(eid)[0] / 1000)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """The chart's series and the rate, as JSON values."""
        now = time.time() if now is None else now
        with self.lock:
            versions = sorted(self.by_version)
            recent = sum(1 for t in self.times if t > now - RATE_WINDOW_S)
            return {
                "versions": versions,
                "mean": [round(self.by_version[v][1] / self.by_version[v][0], 4) for v in versions],
                "samples": [self.by_version[v][0] for v in versions],
                "failures": self.failures,
                "undecodable": self.undecodable,
                "scored_per_s": round(recent / RATE_WINDOW_S, 2),
                "backfill": self.backfill,
            }
