"""What the trajectory browser reads: scored samples from the ``groups`` stream (complete
groups, the samples the learner trains on), one group or sample by its entry ID, and dead
letters.

Every read is bounded. A search walks the stream newest first with ``XREVRANGE ... COUNT``
from a cursor (an entry ID), stops when it has a page of matches or has looked at
``SCAN_LIMIT`` groups, and hands back the cursor to go on from: a search on a run with
millions of groups costs one bounded step per click, never a read of the whole stream. While
scanning, only each sample's Score is decoded (the trajectory stays raw bytes) unless the
search looks into the text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.shards import run_shards
from streamrl.bus.values import as_str, id_order

PAGE_SAMPLES = 50  # matches shown per page
SCAN_PAGE = 200  # groups read per XREVRANGE
SCAN_LIMIT = 2000  # groups one search request looks at, at most
DEAD_SHOWN = 20


class _SampleHead(msgspec.Struct):
    """A Sample with its trajectory left undecoded: what a scan needs to filter."""

    score: schema.Score
    trajectory: msgspec.Raw


class _GroupHead(msgspec.Struct, array_like=True):
    v: int
    prompt_id: str
    group_size: int
    reward_mean: float
    reward_std: float
    samples: list[_SampleHead]


_GROUP_HEAD = msgspec.msgpack.Decoder(_GroupHead)


@dataclass
class Query:
    """A search: every filter set must match. ``prompt`` and ``text`` are substrings (``text``
    is looked for in every item of the episode); ``version`` is a policy version that
    generated one of the sample's turns."""

    prompt: str = ""
    env: str = ""
    verifier_version: str = ""
    version: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    text: str = ""

    def keeps(self, head: _SampleHead) -> bool:
        s = head.score
        if self.prompt and self.prompt not in s.prompt_id:
            return False
        if self.env and self.env != s.env:
            return False
        if self.verifier_version and self.verifier_version != s.verifier_version:
            return False
        if self.version is not None and self.version not in s.policy_versions:
            return False
        if s.reward is None:
            return self.min_reward is None and self.max_reward is None
        if self.min_reward is not None and s.reward < self.min_reward:
            return False
        return not (self.max_reward is not None and s.reward > self.max_reward)

    def keeps_text(self, traj: schema.Trajectory) -> bool:
        needle = self.text.lower()
        return any(needle in _item_text(i).lower() for i in traj.items)


def _item_text(item: schema.Item) -> str:
    if isinstance(item, schema.FunctionCall):
        return f"{item.name} {item.arguments}"
    if isinstance(item, schema.FunctionCallOutput):
        return item.output
    return item.content


@dataclass
class Row:
    """One sample in a result list."""

    shard: int
    entry_id: str
    k: int
    prompt_id: str
    task_id: str
    env: str
    reward: float | None
    failure: str | None
    versions: list[int]
    verifier: str
    verifier_version: str
    scored_at: float
    group_mean: float


@dataclass
class Page:
    rows: list[Row] = field(default_factory=list)
    scanned: int = 0  # groups looked at
    undecodable: int = 0
    next_cursor: str | None = None  # where older entries go on from; None: no older ones
    oldest: str | None = None  # the oldest entry ID looked at


_EXHAUSTED = "x"


def parse_cursor(cursor: str | None, shards: int) -> list[str | None]:
    """Per shard, the entry ID to read below (exclusive), None for the newest entry, or
    ``"x"`` for a shard read to its start. A cursor is one ID per shard, comma-separated (an
    unsharded run's cursor is a plain entry ID): stream IDs of different shards can be equal,
    so one ID cannot stand for where every shard stands. ValueError for anything else."""
    if not cursor:
        return [None] * shards
    parts = cursor.split(",")
    if len(parts) != shards:
        raise ValueError(f"{cursor!r} is not a cursor of a run with {shards} shard(s)")
    for part in parts:
        if part != _EXHAUSTED:
            id_order(part)
    return list(parts)


def search(r: redis.Redis, run: str, q: Query, cursor: str | None = None) -> Page:
    """Newest first from ``cursor`` (see ``parse_cursor``), over every shard."""
    shards = run_shards(r, run)
    page = Page()
    bounds = parse_cursor(cursor, len(shards))
    # per shard: entries read and not yet looked at, and whether the stream has more below
    buffers: dict[int, list[tuple[bytes, dict]]] = {i: [] for i in range(len(shards))}
    more = {i: bounds[i] != _EXHAUSTED for i in range(len(shards))}
    read_to = dict(enumerate(bounds))  # the last ID read from each shard
    while page.scanned < SCAN_LIMIT and len(page.rows) < PAGE_SAMPLES:
        for i, keys in enumerate(shards):  # keep one page per shard buffered
            if not buffers[i] and more[i]:
                high = "+" if read_to[i] is None else f"({read_to[i]}"
                rows = r.xrevrange(keys.groups, max=high, count=SCAN_PAGE)
                more[i] = len(rows) == SCAN_PAGE
                if rows:
                    read_to[i] = as_str(rows[-1][0])
                buffers[i] = rows
        live = [i for i in buffers if buffers[i]]
        if not live:
            break
        # the newest entry across shards (equal IDs: the higher shard first)
        i = max(live, key=lambda j: (id_order(buffers[j][0][0]), j))
        eid, fields = buffers[i].pop(0)
        bounds[i] = as_str(eid)
        page.scanned += 1
        page.oldest = as_str(eid)
        _scan_group(page, q, i, as_str(eid), fields)
    for i in range(len(shards)):
        if not buffers[i] and not more[i]:
            bounds[i] = _EXHAUSTED
    if any(b != _EXHAUSTED for b in bounds):
        page.next_cursor = ",".join(b or "" for b in bounds)
    return page


def _scan_group(page: Page, q: Query, shard: int, eid: str, fields: dict) -> None:
    try:
        group = _GROUP_HEAD.decode(fields[b"p"])
    except (KeyError, msgspec.DecodeError, msgspec.ValidationError):
        page.undecodable += 1
        return
    for head in group.samples:
        s = head.score
        if not q.keeps(head):
            continue
        if q.text:
            try:
                traj = schema.TRAJECTORY.decode(head.trajectory)
            except (msgspec.DecodeError, msgspec.ValidationError):
                page.undecodable += 1
                continue
            if not q.keeps_text(traj):
                continue
        page.rows.append(
            Row(
                shard=shard,
                entry_id=eid,
                k=s.k,
                prompt_id=s.prompt_id,
                task_id=s.task_id,
                env=s.env,
                reward=s.reward,
                failure=s.failure,
                versions=s.policy_versions,
                verifier=s.verifier,
                verifier_version=s.verifier_version,
                scored_at=s.scored_at,
                group_mean=group.reward_mean,
            )
        )


class NotFound(LookupError):
    """No such entry (trimmed, a wrong ID, or a shard the run does not have)."""


def shard_keys_of(r: redis.Redis, run: str, shard: int) -> Keys:
    shards = run_shards(r, run)
    if not 0 <= shard < len(shards):
        raise NotFound(f"the run has {len(shards)} shard(s), not a shard {shard}")
    return shards[shard]


def _entry(r: redis.Redis, stream: str, entry_id: str) -> dict:
    try:
        id_order(entry_id)
    except ValueError as e:
        raise NotFound(str(e)) from None
    rows = r.xrange(stream, min=entry_id, max=entry_id, count=1)
    if not rows:
        raise NotFound(f"no entry {entry_id} in {stream} (trimmed, or never there)")
    return rows[0][1]


def group(r: redis.Redis, run: str, shard: int, entry_id: str) -> schema.Group:
    """One complete group by its entry ID in the groups stream."""
    fields = _entry(r, shard_keys_of(r, run, shard).groups, entry_id)
    try:
        return schema.GROUP.decode(fields[b"p"])
    except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as e:
        raise NotFound(f"entry {entry_id} does not decode as a group: {e}") from None


def ranked(g: schema.Group) -> list[schema.Sample]:
    """The group's samples best first (failures last; ties by sample index)."""
    return sorted(
        g.samples,
        key=lambda s: (s.score.reward is None, -(s.score.reward or 0.0), s.score.k),
    )


# ---------------------------------------------------------------- dead letters


@dataclass
class Dead:
    shard: int
    entry_id: str
    letter: schema.DeadLetter | None
    problem: str = ""  # why the entry does not decode


def _dead(shard: int, eid: str, fields: dict) -> Dead:
    try:
        return Dead(shard, eid, schema.DEAD_LETTER.decode(fields[b"p"]))
    except (KeyError, msgspec.DecodeError, msgspec.ValidationError) as e:
        return Dead(shard, eid, None, f"does not decode: {e}")


def dead_letters(r: redis.Redis, run: str, count: int = DEAD_SHOWN) -> list[Dead]:
    """The newest ``count`` dead letters over every shard."""
    found = []
    for i, keys in enumerate(run_shards(r, run)):
        found += [(i, as_str(eid), f) for eid, f in r.xrevrange(keys.dead, count=count)]
    found.sort(key=lambda row: id_order(row[1]), reverse=True)
    return [_dead(i, eid, f) for i, eid, f in found[:count]]


def dead_letter(r: redis.Redis, run: str, shard: int, entry_id: str) -> Dead:
    fields = _entry(r, shard_keys_of(r, run, shard).dead, entry_id)
    return _dead(shard, entry_id, fields)


def dead_payload(letter: schema.DeadLetter) -> schema.Task | schema.Trajectory | None:
    """The entry a dead letter carries, as its stage wrote it: a task (rollout stage) or a
    trajectory (verify stage); None for anything else (a dataset row that did not parse)."""
    decoder: Any = {"rollout": schema.TASK, "verify": schema.TRAJECTORY}.get(letter.stage)
    if decoder is None or not letter.payload:
        return None
    try:
        return decoder.decode(letter.payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
