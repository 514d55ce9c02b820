"""The learner's consumer on the ``groups`` streams: reading in turn, re-reading, acking.

Shards. A sharded run (``[streams] shards``) has one ``groups`` stream per shard; the learner
reads all of them, a shard at a time in turn, and every entry is known by (shard, id). The
checkpoint records the newest covered entry of each shard (``last_ids``), acks go to each
entry's own shard, and a restart re-reads each shard's pending entries, skipping what its
shard's ``last_ids`` covers: every group still affects the weights exactly once. (The order
of entries from different shards depends on arrival, so a restarted sharded learner is
exactly-once but not bitwise-equal to an uninterrupted one.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from streamrl.bus.keys import Keys, shard_keys
from streamrl.bus.values import as_str
from streamrl.defaults import LEARNER_GROUP, SHARD_BLOCK_MS
from streamrl.workers.context import read_config

Ref = tuple[int, str]  # (shard index, entry id): one entry of one shard's groups stream
Row = tuple[int, str, dict]  # (shard index, entry id, the entry's fields)


def resolve_shards(r: redis.Redis, run: str, shards: int | None) -> list[Keys]:
    """The run's shards: its stored config's count, else ``shards``, else 1."""
    stored = read_config(r.get(Keys(run).config))
    if stored is not None:
        if shards is not None and shards != stored.streams.shards:
            raise ValueError(
                f"run {run!r} has {stored.streams.shards} shards, but the learner was told "
                f"{shards}: [streams] shards must match the producer's"
            )
        return shard_keys(run, stored.streams.shards)
    return shard_keys(run, shards or 1)


@dataclass
class GroupsReader:
    """One consumer (``consumer``, stable across restarts) of group ``learner`` on every
    shard's ``groups`` stream."""

    r: redis.Redis
    shards: list[Keys]  # every shard's keys; [keys] unsharded
    consumer: str
    count: int  # entries per XREADGROUP
    last_taken: dict[int, str] = field(default_factory=dict)  # per shard: newest id taken
    _turn: int = 0  # the shard read first next time (round robin)

    @property
    def sharded(self) -> bool:
        return len(self.shards) > 1

    def _read_shard(self, shard: int, start: str, block_ms: int | None) -> list[Row]:
        resp = self.r.xreadgroup(
            LEARNER_GROUP,
            self.consumer,
            {self.shards[shard].groups: start},
            count=self.count,
            block=block_ms,
        )
        return [
            (shard, as_str(eid), fields)
            for _stream, entries in resp or ()
            for eid, fields in entries
        ]

    def read(self, start: str, block_ms: int | None) -> list[Row]:
        """New entries. Several shards are read in turn without blocking; only when all are
        empty does the learner block, on one shard and for at most ``SHARD_BLOCK_MS``, so no
        shard waits long behind another."""
        if not self.sharded:
            return self._read_shard(0, start, block_ms)
        n = len(self.shards)
        for j in range(n):
            shard = (self._turn + j) % n
            rows = self._read_shard(shard, start, None)
            if rows:
                self._turn = (shard + 1) % n
                return rows
        shard, self._turn = self._turn, (self._turn + 1) % n
        block = block_ms if block_ms is None else min(block_ms, SHARD_BLOCK_MS)
        return self._read_shard(shard, start, block)

    def read_pending(self) -> list[Row]:
        """This consumer's delivered-but-unacked entries, oldest first in each shard."""
        out: list[Row] = []
        for shard in range(len(self.shards)):
            start = "0"
            while True:
                rows = self._read_shard(shard, start, None)
                if not rows:
                    break
                out.extend(rows)
                start = rows[-1][1]
        return out

    def read_lost(self) -> list[Row]:
        """Entries delivered to us that we never saw. redis-py re-sends a command after a
        dropped connection (a Redis restart); if the first XREADGROUP had been served, its
        entries sit in our pending list, newer than anything taken, until we read them."""
        out: list[Row] = []
        for shard in range(len(self.shards)):
            out += self._read_shard(shard, self.last_taken.get(shard, "0-0"), None)
        return out

    def ack(self, refs: list[Ref]) -> None:
        for shard in sorted({s for s, _ in refs}):
            ids = [i for s, i in refs if s == shard]
            for j in range(0, len(ids), 1000):
                self.r.xack(self.shards[shard].groups, LEARNER_GROUP, *ids[j : j + 1000])
