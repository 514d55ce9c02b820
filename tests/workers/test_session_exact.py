"""Sessions are checkpointed in a packed form (``session_codec.SESSION``): token ids as arrays of
uint16/int32/int64, log-probs as float32 when that is exact, each turn's prompt as what it adds
to the previous one, zlib over the whole. Whatever the packing, the trajectory that reaches the
verifier (the ``rollouts`` stream) and the learner (the Group on ``groups``) must carry every
token id and log-prob the sampler produced, bit for bit, even when the episode was resumed from
its packed checkpoint after every turn."""

from __future__ import annotations

import asyncio
import math
import random
import string
import struct
import zlib
from array import array

import msgspec
import pytest
import redis.asyncio

from streamrl import schema, session_codec
from streamrl.bus.keys import Keys
from streamrl.bus.streams import Scripts, claim_args, ensure_groups, parse_claim, parse_read
from streamrl.config import RolloutConfig, RunConfig
from streamrl.defaults import ROLLOUT_GROUP, VERIFY_GROUP
from streamrl.envs import make_env
from streamrl.policy.base import Policy, PolicyError, PolicyRequest
from streamrl.producer.produce import Producer
from streamrl.workers.envs import EnvTable
from streamrl.workers.rollout import _RolloutLease
from streamrl.workers.verify import _VerifyLease


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _bits(values: list[float]) -> bytes:
    return array("d", values).tobytes()


# log-probs a sampler may hand back: float32 values (torch, vLLM), and values a float32 cannot
# hold (a server that answers in float64), with the awkward ones among them
EXACT32 = [_f32(-0.1), -0.0, 0.0, -math.inf, _f32(-1e-40), _f32(-87.3), float("nan")]
WIDE = [-0.1, -1e-300, -(2.0**-1074), -1e300, float("nan"), -0.0]


class RecordingPolicy(Policy):
    """Plays the environment's reference answer, with token ids and log-probs chosen to cover
    every packing (ids over 65,535 and over 2**31; a prompt that does not extend the previous
    turn's), and fails every other call of an episode, so that the episode is resumed from its
    checkpoint after every turn. ``produced`` keeps a copy of every turn it answered."""

    name = "recording"

    def __init__(self, env):
        self.env = env
        self.calls: dict[str, int] = {}
        self.produced: dict[tuple[str, int], schema.ModelTurn] = {}

    async def respond(self, request: PolicyRequest) -> schema.ModelTurn:
        tid = request.task.task_id
        self.calls[tid] = self.calls.get(tid, 0) + 1
        if self.calls[tid] % 2 == 0:
            raise PolicyError("the sampler went away (a test's crash)")
        t, k = request.turn, request.task.k
        ids = [[5, 49151, 7], [70000, 3, 0], [2**31 + 9, 1], [1, 2, 3, 4]][t % 4]
        lps = (EXACT32 if (t + k) % 2 == 0 else WIDE)[: len(ids)]
        prev = request.previous
        if prev is None or t == 2:  # turn 2: a prompt rendered afresh, not an extension
            prompt = [100 + t, 200 + k, *range(t * 3)]
        else:
            prompt = [*prev.prompt_token_ids, *prev.token_ids, 11, 12 + t]
        item = self.env.reference(request.task, request.items, request.state)
        turn = schema.ModelTurn(
            index=t,
            items=[item],
            prompt_token_ids=prompt,
            token_ids=ids,
            logprobs=lps,
            policy_version=7,
        )
        self.produced[(request.task.task_id, t)] = msgspec.msgpack.decode(
            msgspec.msgpack.encode(turn), type=schema.ModelTurn
        )
        return turn


@pytest.fixture
def appends(monkeypatch):
    """Checkpoints append frames to values of any size (a value under 2 KB is rewritten whole,
    and these sessions are small)."""
    monkeypatch.setattr(session_codec, "_APPEND_FROM", 0)


def test_a_small_session_is_rewritten_whole_and_a_large_one_appended():
    call = schema.FunctionCall(call_id="c", name="f", arguments="{}")
    session = _session([schema.ModelTurn(index=0, items=[call], token_ids=[1])], [])
    _, mark = session_codec.SESSION.frame(session, None)
    assert session_codec.SESSION.frame(session, mark)[0][2:6] == b"\0\0\0\0"  # offset 0: whole
    noise = "".join(random.Random(0).choices(string.printable, k=4000))  # does not compress
    session.items.append(schema.FunctionCallOutput(call_id="c", output=noise))
    big, mark = session_codec.SESSION.frame(session, mark)
    assert mark.length >= 2048
    session.turns.append(schema.ModelTurn(index=1, items=[call], token_ids=[2]))
    session.items.append(call)
    frame, _ = session_codec.SESSION.frame(session, mark)
    assert struct.unpack("<I", frame[2:6])[0] == len(big) and len(frame) < 200
    assert session_codec.SESSION.decode(big + frame) == session


def _frames(value: bytes) -> int:
    """How many checkpoint frames a session's value holds (each: 0xC1, format, offset, size)."""
    at, n = 0, 0
    while at < len(value):
        assert value[at] == 0xC1 and struct.unpack("<I", value[at + 2 : at + 6])[0] == at
        at += 10 + struct.unpack("<I", value[at + 6 : at + 10])[0]
        n += 1
    return n


def _same_turns(turns: list[schema.ModelTurn], produced: dict, task_id: str) -> None:
    assert len(turns) == 4
    for t in turns:
        want = produced[(task_id, t.index)]
        assert t.token_ids == want.token_ids
        assert t.prompt_token_ids == want.prompt_token_ids
        assert _bits(t.logprobs) == _bits(want.logprobs)  # bit for bit, NaN and -0.0 included
        assert t.items == want.items and t.policy_version == 7


def test_tokens_and_logprobs_reach_verifier_and_learner_bit_for_bit(redis_url, run_name, appends):
    cfg = RunConfig(
        run=run_name,
        env="counter",
        group_size=2,
        env_options={"steps": 3},  # 4 model turns
        rollout=RolloutConfig(max_turns=5),
    )
    keys = Keys(run_name)
    sync = redis.Redis.from_url(redis_url)
    ensure_groups(sync, keys)
    sync.set(keys.config, msgspec.msgpack.encode(cfg))
    env = make_env("counter", steps=3)
    Producer(sync, run_name).from_env(env, 1, 2, seed=0)
    policy = RecordingPolicy(env)

    async def roll() -> int:
        r = redis.asyncio.Redis.from_url(redis_url)
        lease = _RolloutLease(r, run_name, "W")
        lease.config, lease.keys, lease.table, lease.policy = cfg, keys, EnvTable(cfg), policy
        entries = parse_read(await r.xreadgroup(ROLLOUT_GROUP, "W", {keys.tasks: ">"}, count=9))
        rounds = 0
        while entries:  # every round: one turn more, from the packed checkpoint in Redis
            rounds += 1
            await asyncio.gather(*(lease._episode(e) for e in entries))
            _, entries = parse_claim(
                await lease.scripts.claim(
                    keys=[keys.tasks],
                    args=claim_args(ROLLOUT_GROUP, "W", 0, 9, "0-0", True, keys.session("")),
                )
            )
            # one frame appended per checkpointed turn, whoever wrote it
            assert all(_frames(e.session) == rounds for e in entries)
        await r.aclose()
        assert lease.counts["finished"] == 2
        return rounds

    assert asyncio.run(roll()) == 4
    rollouts = [schema.TRAJECTORY.decode(f[b"p"]) for _, f in sync.xrange(keys.rollouts)]
    assert sorted(t.k for t in rollouts) == [0, 1]
    for traj in rollouts:  # what the verifier reads
        assert traj.resumed_from_turn == 3 and traj.attempt == 4
        _same_turns(traj.turns, policy.produced, traj.task_id)
    verifier = _VerifyLease(sync, run_name, "V")
    verifier.config, verifier.keys = cfg, keys
    verifier.process(parse_read(sync.xreadgroup(VERIFY_GROUP, "V", {keys.rollouts: ">"})))
    ((_, fields),) = sync.xrange(keys.groups)
    group = schema.GROUP.decode(fields[b"p"])  # what the learner reads
    for sample in group.samples:
        _same_turns(sample.trajectory.turns, policy.produced, sample.trajectory.task_id)
    assert not list(sync.scan_iter(match=keys.session("*")))
    sync.close()


def _session(turns: list[schema.ModelTurn], between: list[schema.Item]) -> schema.Session:
    items: list[schema.Item] = [schema.Message(role="user", content="go")]
    for t in turns:
        items += t.items + between
    return schema.Session(task_id="p:0", items=items, turns=turns, state=b"\x81", tokens=9)


@pytest.mark.parametrize(
    ("ids", "code"), [([0, 65535], b"H"), ([65536, 1], b"i"), ([-1, 5], b"i"), ([2**40], b"q")]
)
def test_packed_session_is_the_same_session(ids, code):
    """Each id and log-prob packing, turns whose items are not in the conversation, and the
    plain (unpacked) form written by older workers, which still decodes."""
    call = schema.FunctionCall(call_id="c", name="f", arguments="{}")
    out = schema.FunctionCallOutput(call_id="c", output="x" * 300)
    turns = [
        schema.ModelTurn(index=0, items=[call], prompt_token_ids=[1, 2], token_ids=ids,
                         logprobs=EXACT32[: len(ids)], worker="w", seconds=0.25),
        schema.ModelTurn(index=1, items=[call], prompt_token_ids=[1, 2, *ids, 9],
                         token_ids=[3], logprobs=[-0.1], policy_version=2),
        schema.ModelTurn(index=2, items=[], finish_reason="length"),
    ]  # fmt: skip
    session = _session(turns, [out])
    session.turns.append(
        schema.ModelTurn(index=3, items=[schema.Reasoning(content="not in the conversation")])
    )
    packed = session_codec.SESSION.encode(session)
    assert packed[:1] == b"\xc1"
    back = session_codec.SESSION.decode(packed)
    plain = session_codec.SESSION.decode(schema.encode(session))  # the form older workers wrote
    for other in (back, plain):
        for a, b in zip(other.turns, session.turns, strict=True):
            assert _bits(a.logprobs) == _bits(b.logprobs)  # NaN != NaN: compare the bits
            a.logprobs = b.logprobs
        assert other == session
    body = zlib.decompress(packed[10:]) if packed[1] == 4 else packed[10:]
    assert code in body


def test_checkpoints_append_frames_once_and_rewrite_a_lost_session(r, run_name, appends):
    """The COMMIT script: a frame at offset 0 replaces the value, a later one is appended
    only where the value is exactly as long as its offset says; a re-sent one changes
    nothing, and one whose session expired is refused (2) for the worker to write it whole."""
    keys = Keys(run_name)
    ensure_groups(r, keys)
    Producer(r, run_name).from_env(make_env("counter", steps=3), 1, 1, seed=0)
    (e,) = parse_read(r.xreadgroup(ROLLOUT_GROUP, "W", {keys.tasks: ">"}, count=1))
    commit = Scripts(r).commit
    call = schema.FunctionCall(call_id="c", name="add", arguments="{}")
    session = _session([schema.ModelTurn(index=0, items=[call], token_ids=[1, 2])], [])
    first, mark = session_codec.SESSION.frame(session, None)
    session.turns.append(schema.ModelTurn(index=1, items=[call], token_ids=[3]))
    session.items.append(call)
    session.state = b"\x82"
    second, _ = session_codec.SESSION.frame(session, mark)

    def put(blob: bytes) -> int:
        (res,) = commit(
            keys=[keys.tasks, keys.session(e.task_id)], args=[ROLLOUT_GROUP, "W", 60, e.id, 1, blob]
        )
        return res

    assert put(first) == 1 and put(second) == 1
    assert put(second) == 1  # a re-sent checkpoint (a client retry): not appended twice
    value = r.get(keys.session(e.task_id))
    assert value == first + second and session_codec.SESSION.decode(value) == session
    other = second[:-1] + bytes([second[-1] ^ 1])  # not what this worker appended there
    assert put(other) == 2 and r.get(keys.session(e.task_id)) == first + second
    r.delete(keys.session(e.task_id))  # the session expired
    assert put(second) == 2 and r.get(keys.session(e.task_id)) is None
    with pytest.raises(msgspec.DecodeError, match="missing"):
        session_codec.SESSION.decode(second.replace(second[2:6], b"\0\0\0\0", 1))


def test_packing_covers_every_field_of_a_session_and_a_turn():
    """A field added to Session or ModelTurn must be added to the packed form too, or
    checkpoints would drop it silently."""
    assert {f.name for f in msgspec.structs.fields(schema.ModelTurn)} == {
        f.name for f in msgspec.structs.fields(session_codec._PackedTurn)
    } - {"start", "end", "prompt_keep", "prompt_tail", "prompt_text"} | {"prompt_token_ids"}
    assert {f.name for f in msgspec.structs.fields(schema.Session)} == {
        f.name for f in msgspec.structs.fields(session_codec._Frame)
    } - {"items_from", "turns_from", "tokenizer", "refs"}


def _head(fmt: int, offset: int, size: int) -> bytes:
    return bytes([0xC1, fmt]) + struct.pack("<II", offset, size)


def _frame_with_ids(ids: bytes) -> bytes:
    turn = session_codec._PackedTurn(0, 0, 0, [], 0, b"", ids, b"", 0, "stop", "", 0.0)
    body = msgspec.msgpack.encode(
        session_codec._Frame(1, "p:0", 0, [], 0, [turn], b"", 0, 0, 0, 1, -1)
    )
    return _head(3, 0, len(body)) + body


@pytest.mark.parametrize(
    "blob",
    [
        b"\xc1",
        _head(4, 0, 8) + b"not zlib",
        _head(9, 0, 1) + b"\x93",
        _head(3, 0, 1) + b"\x93",
        _head(3, 0, 5) + b"\x93",  # shorter than it says
        _head(3, 7, 1) + b"\x93",  # a frame that is not where it says
        _frame_with_ids(b"u" + "ab".encode("utf-32-le")),  # token ids that are characters
        _frame_with_ids(b"H\x01"),  # half a uint16
    ],
)
def test_unreadable_packed_sessions_are_decode_errors(blob):
    with pytest.raises(msgspec.DecodeError):
        session_codec.SESSION.decode(blob)


def test_a_worker_whose_session_expired_writes_it_whole(redis_url, run_name, appends):
    """The worker appends to the value it last wrote; when that value is gone (its TTL ran
    out mid-episode) the checkpoint is written whole, not lost and not appended to nothing."""
    cfg = RunConfig(run=run_name, env="counter", env_options={"steps": 3})
    keys = Keys(run_name)
    sync = redis.Redis.from_url(redis_url)
    ensure_groups(sync, keys)
    Producer(sync, run_name).from_env(make_env("counter", steps=3), 1, 1, seed=0)
    (e,) = parse_read(sync.xreadgroup(ROLLOUT_GROUP, "W", {keys.tasks: ">"}, count=1))
    call = schema.FunctionCall(call_id="c", name="add", arguments="{}")
    session = _session([schema.ModelTurn(index=0, items=[call], token_ids=[1])], [])

    async def checkpoint() -> list[int]:
        r = redis.asyncio.Redis.from_url(redis_url)
        lease = _RolloutLease(r, run_name, "W")
        lease.config, lease.keys = cfg, keys
        assert await lease._flush_commits([(e, session)]) == [1]
        sync.delete(keys.session(e.task_id))  # expired
        session.turns.append(schema.ModelTurn(index=1, items=[call], token_ids=[2]))
        session.items.append(call)
        done = await lease._flush_commits([(e, session)])
        await r.aclose()
        return done

    assert asyncio.run(checkpoint()) == [1]
    # written against its task's payload, as every worker writes a session
    assert session_codec.SESSION.decode(sync.get(keys.session(e.task_id)), e.payload) == session
    sync.close()
