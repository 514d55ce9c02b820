"""The session's packed form: what a rollout worker checkpoints to Redis after every turn.

A session is checkpointed after every turn and holds every token of the episode so far, so
its size is what an open episode costs Redis. As plain msgpack (``encode(session)``, the form
of streamrl before 2026-11-25) a token id takes 3-5 bytes, a log-prob 9, every turn repeats
the whole prompt's token ids (the conversation so far: quadratic in the turns), each model
turn's items are stored twice (in the turn and in the conversation), and every checkpoint
rewrites all of it. The packed form:

- a model turn's items are a span of the session's items, stored once;
- token ids are a little-endian array of uint16 when every id fits (SmolLM2's 49,152-token
  vocabulary does), else int32, else int64; log-probs float32 when every one of them
  survives the round trip bit for bit (what torch and vLLM sample in), else float64;
- a turn's prompt is stored as how much of the previous turn's prompt + completion it
  keeps and the tokens that follow (the tool outputs and the chat template's glue);
- a checkpoint appends one *frame* with what changed since the last one (new items, new
  turns, the environment state and counters as they are now), zlib-compressed from 1 KB,
  with the task's payload (which Redis holds anyway: the prompt) and the earlier frames'
  payloads as zlib's dictionary: the prompt's text, and a tool's output in one frame and the
  same text in the next turn's prompt, cost their bytes once; a reader gives the same task;
- given the worker's tokenizer (``SessionCodec(tokens)``, the ``hf`` backend's), text it can
  rebuild from ids it keeps anyway is not stored twice: a model turn's items that are
  slices of its decoded tokens are kept as (start, end) in them, and a prompt's tail
  whose ids are exactly the tokenization of their decoded text is kept as that text (which
  the dictionary then finds in the conversation). Such a frame names the tokenizer by a
  fingerprint; a codec without it, or with another, refuses the session (the worker then
  starts the episode afresh, as for any unreadable session).

A frame is 0xC1 (a byte msgpack never uses), a format byte (3: msgpack, 4: zlib, 5: zlib with
the dictionary), the
offset in the session's value where the frame starts and its payload's length (uint32 LE
each), then the payload. The COMMIT script reads the offset: 0 replaces the value, anything
else appends after checking the value is exactly that long (``bus/scripts.py``). Decoding
folds the frames and gives back the same Session, bit for bit; ``SESSION.decode`` also reads
the plain form, so episodes checkpointed by older workers resume on newer ones. Older
workers cannot read frames: upgrade every rollout worker of a run together, or let the
sessions in flight finish first.

Kept whole: it is one wire format, and what its encoder writes its decoder must read back bit
for bit; split apart, a field added on one side is easy to miss on the other.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from collections.abc import Iterator
from typing import NamedTuple, Protocol

import msgspec

from streamrl.schema import (
    PLAIN_SESSION,
    FunctionCall,
    FunctionCallOutput,
    Item,
    Message,
    ModelTurn,
    Reasoning,
    Session,
    encode,
)

_FRAME = 0xC1
_FRAME_RAW, _FRAME_ZLIB, _FRAME_ZDICT = 3, 4, 5
_WINDOW = 32768  # zlib's: the most of the earlier payloads a frame's dictionary can use
_REF_FROM = 16  # characters: a shorter text is kept as it is
_TEXT_FIELD = {Message: "content", Reasoning: "content", FunctionCall: "arguments",
               FunctionCallOutput: "output"}  # fmt: skip


class SessionTokens(Protocol):
    """The tokenizer a worker samples with, as the codec uses it. ``decode`` and ``encode``
    must be pure functions of the tokenizer that ``fingerprint`` names."""

    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


_FRAME_HEAD = 10
_LITTLE = sys.byteorder == "little"
_COMPRESS_FROM = 1024  # bytes: below this zlib saves little and costs more than the packing
_APPEND_FROM = 2048  # bytes: a shorter value is rewritten whole at its next checkpoint


class _PackedTurn(msgspec.Struct, array_like=True, omit_defaults=True):
    index: int
    start: int  # its items are the session's items[start:end] (end < 0: ``items`` holds them)
    end: int
    items: list[Item]
    prompt_keep: int  # leading tokens of the previous turn's prompt + completion it repeats
    prompt_tail: bytes
    token_ids: bytes
    logprobs: bytes
    policy_version: int
    finish_reason: str
    worker: str
    seconds: float
    prompt_text: str | None = None  # the tail as text: its ids are ``tokens.encode`` of it


class _Frame(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one checkpoint adds to a session: the items and turns after the first
    ``items_from`` and ``turns_from``, and every other field as it stands now."""

    v: int
    task_id: str
    items_from: int
    items: list[Item]
    turns_from: int
    turns: list[_PackedTurn]
    state: bytes
    tokens: int
    started_at: float
    tool_seconds: float
    claims: int
    resumed_from_turn: int
    tokenizer: str = ""  # the fingerprint of the tokenizer that ``refs`` and prompt texts need
    # (item, turn, start, end): that item's text is ``tokens.decode(turn's token ids)[start:end]``
    refs: list[tuple[int, int, int, int]] = []


class SessionMark(NamedTuple):
    """How much of a session its value in Redis holds: its length in bytes and the items and
    turns in it. The next checkpoint appends a frame with the rest, compressed with
    ``history`` (the last 32 KB of the frames' payloads) as its dictionary."""

    length: int
    items: int
    turns: int
    history: bytes = b""


_FRAME_DECODER = msgspec.msgpack.Decoder(_Frame)
_INT_CODES = ((b"H", 0, 1 << 16), (b"i", -(1 << 31), 1 << 31), (b"q", -(1 << 63), 1 << 63))
_IDS, _FLOATS = "Hiq", "fd"  # the array types a packed turn may hold


def _pack(arr: array) -> bytes:
    if not _LITTLE:
        arr.byteswap()
    return arr.typecode.encode() + arr.tobytes()


def _unpack(blob: bytes, codes: str) -> list:
    if not blob:
        return []
    if blob[:1].decode() not in codes:
        raise ValueError(f"an array of type {blob[:1]!r} where one of {codes!r} belongs")
    arr = array(blob[:1].decode())
    arr.frombytes(blob[1:])
    if not _LITTLE:
        arr.byteswap()
    return arr.tolist()


def _pack_ids(ids: list[int]) -> bytes:
    if not ids:
        return b""
    low, high = min(ids), max(ids)
    code = next((c for c, lo, hi in _INT_CODES if lo <= low and high < hi), None)
    if code is None:
        raise ValueError(f"a token id outside int64: {low if low < 0 else high}")
    return _pack(array(code.decode(), ids))


def _pack_floats(values: list[float]) -> bytes:
    if not values:
        return b""
    wide = array("d", values)
    narrow = array("f", values)  # out-of-range values turn to inf here: caught below
    if array("d", narrow).tobytes() == wide.tobytes():
        return _pack(narrow)
    return _pack(wide)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading elements ``a`` and ``b`` share (a turn's prompt usually extends the
    previous turn's prompt + completion: one list comparison then settles it)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid
    return low


def _span(items: list[Item], part: list[Item], start: int) -> int:
    """Where ``part`` sits in ``items`` at or after ``start``; -1 when it does not. (A turn's
    items are usually the very objects the conversation holds: ``is`` finds them first.)"""
    n = len(part)
    if n == 0:
        return start if start <= len(items) else -1
    first = part[0]
    for i in range(start, len(items) - n + 1):
        item = items[i]
        if (item is first or item == first) and (n == 1 or items[i : i + n] == part):
            return i
    return -1


def _pack_turn(
    s: Session, i: int, cursor: int, tokens: SessionTokens | None
) -> tuple[_PackedTurn, int, int]:
    """Turn ``i`` packed, the cursor after its items, and where its items start (-1: they are
    not a span of the conversation)."""
    t = s.turns[i]
    keep = 0
    if i and t.prompt_token_ids:
        prev = s.turns[i - 1]
        keep = _common_prefix([*prev.prompt_token_ids, *prev.token_ids], t.prompt_token_ids)
    start = _span(s.items, t.items, cursor)
    if start >= 0:
        cursor = start + len(t.items)
    tail = t.prompt_token_ids[keep:] if t.prompt_token_ids else []
    text = _as_text(tail, tokens) if tokens is not None and tail else None
    packed = _PackedTurn(
        t.index,
        max(start, 0),
        cursor if start >= 0 else -1,
        [] if start >= 0 else t.items,
        keep,
        _pack_ids(tail) if text is None else b"",
        _pack_ids(t.token_ids),
        _pack_floats(t.logprobs),
        t.policy_version,
        t.finish_reason,
        t.worker,
        t.seconds,
        text,
    )
    return packed, cursor, start


def _as_text(ids: list[int], tokens: SessionTokens) -> str | None:
    """The text whose tokenization is exactly ``ids``, if decoding them gives one."""
    try:
        text = tokens.decode(ids)
        return text if tokens.encode(text) == ids else None
    except Exception:  # ids the tokenizer does not know (a backend's own): keep the ids
        return None


def _decoded(ids: list[int], tokens: SessionTokens) -> str:
    try:
        return tokens.decode(ids)
    except Exception:
        return ""


def _refs(
    s: Session, i: int, start: int, n_items: int, items: list[Item], tokens: SessionTokens
) -> list[tuple[int, int, int, int]]:
    """Turn ``i``'s items (the conversation's from ``start``) whose text is a slice of its
    decoded tokens: blanked in ``items`` (this frame's, from ``n_items``) and returned as
    references."""
    t, refs, decoded = s.turns[i], [], None
    for k in range(max(start, n_items), start + len(t.items)):
        item = s.items[k]
        field = _TEXT_FIELD[type(item)]
        text = getattr(item, field)
        if len(text) < _REF_FROM:
            continue
        if decoded is None:
            decoded = _decoded(t.token_ids, tokens)
        at = decoded.find(text)
        if at >= 0:
            refs.append((k, i, at, at + len(text)))
            items[k - n_items] = msgspec.structs.replace(item, **{field: ""})
    return refs


def _compress(body: bytes, history: bytes) -> tuple[int, bytes]:
    """The frame's format and payload: from ``_COMPRESS_FROM`` bytes zlib, with the task and
    the earlier payloads as its dictionary when there are any; else as it is (also when that
    is smaller)."""
    if len(body) < _COMPRESS_FROM:
        return _FRAME_RAW, body
    if history:
        c = zlib.compressobj(6, zdict=history)
        packed, fmt = c.compress(body) + c.flush(), _FRAME_ZDICT
    else:
        packed, fmt = zlib.compress(body, 6), _FRAME_ZLIB
    return (fmt, packed) if len(packed) < len(body) else (_FRAME_RAW, body)


def _frames(blob: bytes, task: bytes = b"") -> Iterator[tuple[_Frame, bytes]]:
    """The frames of a packed session's value, in order, each with the dictionary the next
    one would be compressed with (``ValueError`` and zlib's errors for a value that is not
    one). ``task``: the dictionary the first frame was compressed with."""
    at, history = 0, task[-_WINDOW:]
    while at < len(blob):
        head = blob[at : at + _FRAME_HEAD]
        if len(head) < _FRAME_HEAD or head[0] != _FRAME:
            raise ValueError(f"no frame at byte {at}")
        offset, size = struct.unpack("<II", head[2:])
        body = blob[at + _FRAME_HEAD : at + _FRAME_HEAD + size]
        if offset != at or len(body) != size:
            raise ValueError(f"a frame at byte {at} says {offset} and {size} bytes")
        if head[1] == _FRAME_ZLIB:
            body = zlib.decompress(body)
        elif head[1] == _FRAME_ZDICT:
            if not history:  # compressed against a task or frames this reader does not have
                raise ValueError(
                    "a checkpoint of this session is missing before the first, or its task"
                )
            d = zlib.decompressobj(zdict=history)
            body = d.decompress(body) + d.flush()
            if not d.eof or d.unused_data:
                raise ValueError(f"the frame at byte {at} does not end where it says")
        elif head[1] != _FRAME_RAW:
            raise ValueError(f"unknown session frame format {head[1]}")
        history = (history + body)[-_WINDOW:]
        yield _FRAME_DECODER.decode(body), history
        at += _FRAME_HEAD + size


class SessionCodec:
    """``codec.frame(session, mark)`` packs what a checkpoint adds, ``codec.encode`` a whole
    session (one frame), ``codec.decode(value)`` reads the frames of a session's value and the
    plain form (any ``DecodeError`` for what is neither). ``tokens``: the worker's tokenizer,
    which lets it store less (see the module's docstring); ``SESSION`` has none."""

    def __init__(self, tokens: SessionTokens | None = None) -> None:
        self.tokens = tokens

    def encode(self, s: Session, task: bytes = b"") -> bytes:
        return self.frame(s, None, task)[0]

    def frame(
        self, s: Session, mark: SessionMark | None, task: bytes = b""
    ) -> tuple[bytes, SessionMark]:
        """The frame that brings a session's value from ``mark`` (None: nothing, a new value)
        to ``s``, and the mark after it. Items and turns are only ever appended. A value
        under ``_APPEND_FROM`` bytes is rewritten whole instead: one SET, and the best
        compression, for what costs little to send again. ``task``: the task's payload as
        Redis holds it, the first frame's dictionary (its prompt is then not stored again);
        a reader must give the same bytes."""
        if mark is None or mark.length < _APPEND_FROM:
            mark = None
        offset, n_items, n_turns, history = mark if mark is not None else (0, 0, 0, task[-_WINDOW:])
        items = s.items[n_items:]
        turns, refs, cursor = [], [], 0
        if n_turns:
            last = s.turns[n_turns - 1]
            cursor = max(0, _span(s.items, last.items, 0)) + len(last.items)
        for i in range(n_turns, len(s.turns)):
            packed, cursor, start = _pack_turn(s, i, cursor, self.tokens)
            turns.append(packed)
            if self.tokens is not None and start >= 0:
                refs += _refs(s, i, start, n_items, items, self.tokens)
        body = encode(
            _Frame(
                v=s.v,
                task_id=s.task_id,
                items_from=n_items,
                items=items,
                turns_from=n_turns,
                turns=turns,
                state=s.state,
                tokens=s.tokens,
                started_at=s.started_at,
                tool_seconds=s.tool_seconds,
                claims=s.claims,
                resumed_from_turn=s.resumed_from_turn,
                tokenizer=self.tokens.fingerprint if self.tokens is not None else "",
                refs=refs,
            )
        )
        fmt, payload = _compress(body, history)
        data = bytes([_FRAME, fmt]) + struct.pack("<II", offset, len(payload)) + payload
        after = (history + body)[-_WINDOW:]
        return data, SessionMark(offset + len(data), len(s.items), len(s.turns), after)

    def decode(self, blob: bytes, task: bytes = b"") -> Session:
        return self.decode_marked(blob, task)[0]

    def state(self, blob: bytes, task: bytes = b"") -> bytes:
        """The environment state a session's value holds: readable without its tokenizer."""
        if blob[:1] != bytes([_FRAME]):
            return PLAIN_SESSION.decode(blob).state
        try:
            *_, (last, _) = _frames(blob, task)
        except (zlib.error, ValueError, TypeError, OverflowError, struct.error) as e:
            raise msgspec.DecodeError(f"unreadable packed session: {e}") from e
        return last.state

    def decode_marked(self, blob: bytes, task: bytes = b"") -> tuple[Session, SessionMark | None]:
        """The session and its mark (None for the plain form: the next checkpoint rewrites
        the whole value). ``task``: the bytes the session was written against (``frame``)."""
        if blob[:1] != bytes([_FRAME]):
            return PLAIN_SESSION.decode(blob), None
        items: list[Item] = []
        turns: list[ModelTurn] = []
        last, history = None, b""
        try:
            for f, seen in _frames(blob, task):
                if f.items_from != len(items) or f.turns_from != len(turns):
                    raise ValueError("a checkpoint of this session is missing")
                tokens = self._tokens_for(f)
                items.extend(f.items)
                ids = [_unpack(t.token_ids, _IDS) for t in f.turns]
                decoded: dict[int, str] = {}
                for k, i, a, b in f.refs:
                    j = i - f.turns_from
                    if not (0 <= j < len(f.turns) and f.items_from <= k < len(items)):
                        raise ValueError("a reference outside its frame")
                    if j not in decoded:
                        decoded[j] = tokens.decode(ids[j])  # type: ignore[union-attr]
                    field = _TEXT_FIELD[type(items[k])]
                    items[k] = msgspec.structs.replace(items[k], **{field: decoded[j][a:b]})
                for t, token_ids in zip(f.turns, ids, strict=True):
                    prev = turns[-1] if turns else None
                    before = [*prev.prompt_token_ids, *prev.token_ids] if prev else []
                    if t.prompt_keep > len(before):
                        raise ValueError("a turn keeps more prompt than its previous turn had")
                    if t.prompt_text is not None:
                        tail = tokens.encode(t.prompt_text)  # type: ignore[union-attr]
                    else:
                        tail = _unpack(t.prompt_tail, _IDS)
                    turns.append(
                        ModelTurn(
                            index=t.index,
                            items=items[t.start : t.end] if t.end >= 0 else t.items,
                            prompt_token_ids=[*before[: t.prompt_keep], *tail],
                            token_ids=token_ids,
                            logprobs=_unpack(t.logprobs, _FLOATS),
                            policy_version=t.policy_version,
                            finish_reason=t.finish_reason,
                            worker=t.worker,
                            seconds=t.seconds,
                        )
                    )
                last, history = f, seen
        except (zlib.error, ValueError, TypeError, OverflowError, struct.error) as e:
            raise msgspec.DecodeError(f"unreadable packed session: {e}") from e
        assert last is not None
        session = Session(
            v=last.v,
            task_id=last.task_id,
            items=items,
            turns=turns,
            state=last.state,
            tokens=last.tokens,
            started_at=last.started_at,
            tool_seconds=last.tool_seconds,
            claims=last.claims,
            resumed_from_turn=last.resumed_from_turn,
        )
        return session, SessionMark(len(blob), len(items), len(turns), history)

    def _tokens_for(self, f: _Frame) -> SessionTokens | None:
        """This codec's tokenizer when the frame needs one (``ValueError`` when it has none or
        another)."""
        if not f.tokenizer:
            return None
        if self.tokens is None:
            raise ValueError("it was written with a tokenizer this reader does not have")
        if self.tokens.fingerprint != f.tokenizer:
            raise ValueError(
                f"it was written with tokenizer {f.tokenizer[:12]}, this reader has "
                f"{self.tokens.fingerprint[:12]}"
            )
        return self.tokens


SESSION = SessionCodec()
