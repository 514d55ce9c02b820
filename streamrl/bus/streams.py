"""Consumer-group plumbing shared by every stage: reading, reclaiming, heartbeats, fenced
writes and dead-lettering. Argument building and reply parsing are plain functions so that the
sync client (verifier, learner) and the asyncio client (rollout) share them."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from streamrl import schema
from streamrl.bus import scripts
from streamrl.bus.keys import Keys
from streamrl.bus.values import as_str
from streamrl.defaults import GROUP_DONE_TTL_S, LEARNER_GROUP, ROLLOUT_GROUP, VERIFY_GROUP


@dataclass(slots=True)
class Entry:
    """One stream entry handed to this consumer. ``fence`` is the PEL delivery count at the
    moment we got it; every later write for this entry must present it."""

    id: str
    task_id: str
    payload: bytes
    fence: int
    session: bytes | None = None


def _prompt_of(task_id: str) -> str:
    return task_id.rsplit(":", 1)[0]


def stage_groups(keys: Keys) -> list[tuple[str, str]]:
    return [
        (keys.tasks, ROLLOUT_GROUP),
        (keys.rollouts, VERIFY_GROUP),
        (keys.groups, LEARNER_GROUP),
    ]


def ensure_groups(r: redis.Redis, keys: Keys) -> None:
    """Create every stage's consumer group (idempotent), reading from the stream's start."""
    for stream, group in stage_groups(keys):
        try:
            r.xgroup_create(stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise


def parse_read(resp: Any) -> list[Entry]:
    """XREADGROUP ... > reply: fresh deliveries always carry delivery count 1."""
    out: list[Entry] = []
    for _stream, entries in resp or ():
        for eid, fields in entries:
            if not fields:  # deleted while pending
                continue
            out.append(Entry(as_str(eid), as_str(fields.get(b"id", b"")), fields.get(b"p", b""), 1))
    return out


def parse_claim(resp: Any) -> tuple[str, list[Entry]]:
    cursor, rows = as_str(resp[0]), resp[1]
    return cursor, [
        Entry(as_str(eid), as_str(tid), payload, int(n), sess or None)
        for eid, tid, payload, n, sess in rows
    ]


def claim_args(
    group: str, consumer: str, min_idle_ms: int, count: int, cursor: str, own: bool, sprefix: str
) -> list[Any]:
    return [group, consumer, min_idle_ms, count, cursor, "own" if own else "stale", sprefix]


def heartbeat_args(group: str, consumer: str, held: Sequence[Entry]) -> list[Any]:
    args: list[Any] = [group, consumer]
    for e in held:
        args += [e.id, e.fence]
    return args


def dead_letter(entry: Entry, stage: str, reason: str, kind: str = "") -> bytes:
    """The encoded DeadLetter for an entry leaving ``stage`` for good, payload included."""
    return schema.encode(
        schema.DeadLetter(
            stage=stage,
            entry_id=entry.id,
            reason=reason,
            deliveries=entry.fence,
            task_id=entry.task_id,
            payload=entry.payload,
            at=time.time(),
            kind=kind,
        )
    )


def deadletter_call(
    keys: Keys,
    stream: str,
    group: str,
    consumer: str,
    items: Sequence[tuple[Entry, bytes, bytes]],
    with_session: bool,
    done_ttl_s: int = GROUP_DONE_TTL_S,
) -> tuple[list[str], list[Any]]:
    """Keys and args of DEADLETTER for (entry, dead-letter blob, failure-score blob or b'')."""
    # the scored stream is declared only when an item carries a failure score: a rollout
    # worker never writes one, and its ACL user (``streamrl acl``) may not touch ``scored``
    scored = keys.scored if any(score for _, _, score in items) else keys.dead
    ks = [stream, keys.dead, scored, keys.stats]
    args: list[Any] = [group, consumer, done_ttl_s]
    for e, dl, score in items:
        tid = e.task_id or e.id
        ks += [keys.session(tid) if with_session else keys.key("none"), keys.group(_prompt_of(tid))]
        args += [e.id, e.fence, tid, dl, score]
    return ks, args


class Scripts:
    """The Lua scripts registered on one client (sync or asyncio)."""

    def __init__(self, client: Any):
        self.claim = client.register_script(scripts.CLAIM)
        self.heartbeat = client.register_script(scripts.HEARTBEAT)
        self.commit = client.register_script(scripts.COMMIT)
        self.finish = client.register_script(scripts.FINISH)
        self.score = client.register_script(scripts.SCORE)
        self.deadletter = client.register_script(scripts.DEADLETTER)
        self.produce = client.register_script(scripts.PRODUCE)
        self.trim = client.register_script(scripts.TRIM)


def xrange_all(
    r: redis.Redis, stream: str, start: str = "-", end: str = "+", page: int = 5000
) -> Iterator[tuple[bytes, dict]]:
    """Every entry of a stream from ``start`` to ``end`` (IDs, inclusive), oldest first, read in
    pages (reports and replays)."""
    low = start
    while True:
        rows = r.xrange(stream, min=low, max=end, count=page)
        if not rows:
            return
        yield from rows
        low = "(" + as_str(rows[-1][0])  # after the last one read
