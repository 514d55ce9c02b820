"""With the worker's tokenizer (``SessionCodec(tokens)``) a checkpoint keeps text that token ids
already hold only once: a model turn's items as slices of its decoded tokens, a prompt's tail
as the text it tokenizes from. Frames after the first are compressed against the earlier ones.
Whatever it leaves out must come back exactly, and a reader without that tokenizer must refuse
the session rather than guess."""

from __future__ import annotations

import asyncio
import json
import random
import struct
from array import array

import msgspec
import pytest
import redis
import redis.asyncio

from streamrl import schema, session_codec
from streamrl.bus.keys import Keys
from streamrl.bus.streams import claim_args, ensure_groups, parse_claim, parse_read
from streamrl.config import RolloutConfig, RunConfig
from streamrl.defaults import ROLLOUT_GROUP
from streamrl.envs import make_env
from streamrl.models.tiny import build_tokenizer
from streamrl.policy.base import Policy, PolicyError, PolicyRequest
from streamrl.policy.token_text import TokenizerText
from streamrl.producer.produce import Producer
from streamrl.workers.envs import EnvTable
from streamrl.workers.rollout import _RolloutLease

SENTENCE = "the lookup tool returns a code for each name; call it before you answer."
WORDS = [*SENTENCE.split(" "), "alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf"]


def _bpe(vocab_size: int = 400, seed: int = 0):
    """A byte-level BPE tokenizer with ChatML's markers, trained here on generated text: the
    kind of tokenizer SmolLM2 has, small enough to build in a test."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [
        " ".join(rng.choices(WORDS, k=40)) + ' {"name": "Ada", "code": 17}' for _ in range(200)
    ]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core)


@pytest.fixture(scope="module")
def tok():
    return _bpe()


def _chat(role: str, text: str) -> str:
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


def _episode(tok, turns: int = 3, seed: int = 1) -> list[schema.Session]:
    """An agent episode as an ``hf`` worker checkpoints it: a prompt rendered from the system
    and user messages, each model turn prose and a tool call (sampled ids, float32 log-probs),
    each call's output rendered into the next turn's prompt after the previous prompt and
    completion. Returns the session after each turn."""
    rng = random.Random(seed)

    def prose(n: int) -> str:
        return " ".join(rng.choices(WORDS, k=n))

    system, user = "You have a lookup tool. " + prose(20), "Find the code of Ada. " + prose(60)
    items: list[schema.Item] = [
        schema.Message(role="system", content=system),
        schema.Message(role="user", content=user),
    ]
    session = schema.Session(task_id="p3:1", items=items, started_at=1764000000.0)
    prompt = tok(_chat("system", system) + _chat("user", user) + "<|im_start|>assistant\n")[
        "input_ids"
    ]
    out = []
    for t in range(turns):
        thought = prose(30)
        args = json.dumps({"name": "Ada", "turn": t})
        written = f'{thought}\n<tool_call>{{"name": "lookup", "arguments": {args}}}</tool_call>'
        ids = tok(written)["input_ids"] + [tok.convert_tokens_to_ids("<|im_end|>")]
        lps = [struct.unpack("f", struct.pack("f", -rng.expovariate(2.0)))[0] for _ in ids]
        new = [
            schema.Reasoning(content=thought),
            schema.FunctionCall(call_id=f"c{t}", name="lookup", arguments=args),
        ]
        session.turns.append(
            schema.ModelTurn(index=t, items=new, prompt_token_ids=prompt, token_ids=ids,
                             logprobs=lps, policy_version=2, worker="w1", seconds=0.5)
        )  # fmt: skip
        output = json.dumps({"name": "Ada", "code": 1000 + t, "note": prose(25)})
        session.items += [*new, schema.FunctionCallOutput(call_id=f"c{t}", output=output)]
        tail = tok("\n" + _chat("tool", output) + "<|im_start|>assistant\n")["input_ids"]
        prompt = [*prompt, *ids, *tail]
        out.append(msgspec.msgpack.decode(schema.encode(session), type=schema.Session))
    return out


def _value(codec: session_codec.SessionCodec, sessions: list[schema.Session]) -> bytes:
    """The session's value in Redis after every checkpoint, each appended as a frame."""
    value, mark = b"", None
    for s in sessions:
        frame, mark = codec.frame(s, mark)
        value = frame if struct.unpack("<I", frame[2:6])[0] == 0 else value + frame
    return value


def _bodies(value: bytes, task: bytes = b"") -> list[session_codec._Frame]:
    return [f for f, _ in session_codec._frames(value, task)]


def test_text_in_token_ids_is_stored_once_and_comes_back_exactly(tok, monkeypatch):
    monkeypatch.setattr(session_codec, "_APPEND_FROM", 0)  # every checkpoint appends a frame
    sessions = _episode(tok)
    tokens = session_codec.SessionCodec(TokenizerText(tok))
    value = _value(tokens, sessions)
    assert tokens.decode(value) == sessions[-1]  # bit for bit: floats compare by value here
    back = tokens.decode(value)
    for a, b in zip(back.turns, sessions[-1].turns, strict=True):
        assert struct.pack(f"{len(a.logprobs)}f", *a.logprobs) == struct.pack(
            f"{len(b.logprobs)}f", *b.logprobs
        )
    frames = _bodies(value)
    assert len(frames) == 3 and all(f.tokenizer for f in frames)
    # every turn's prose is a slice of its tokens: blanked in the frame, kept as a reference
    refs = [r for f in frames for r in f.refs]
    assert {(k, i) for k, i, _, _ in refs} >= {(2, 0), (5, 1), (8, 2)}
    assert all(f.items[k - f.items_from].content == "" for f in frames for k, *_ in f.refs if
               isinstance(f.items[k - f.items_from], schema.Reasoning))  # fmt: skip
    # every turn's prompt tail is kept as the text that tokenizes to it, not as ids
    assert all(t.prompt_text is not None and t.prompt_tail == b"" for f in frames for t in f.turns)
    plain = _value(session_codec.SESSION, sessions)
    assert session_codec.SESSION.decode(plain) == sessions[-1]
    assert len(value) < len(plain)


def test_a_reader_without_that_tokenizer_refuses_the_session(tok):
    sessions = _episode(tok)
    value = _value(session_codec.SessionCodec(TokenizerText(tok)), sessions)
    with pytest.raises(msgspec.DecodeError, match="tokenizer this reader does not have"):
        session_codec.SESSION.decode(value)
    other = session_codec.SessionCodec(TokenizerText(build_tokenizer()))  # the tiny model's
    with pytest.raises(msgspec.DecodeError, match="written with tokenizer"):
        other.decode(value)
    # the environment's state is still readable (closing a server session needs no tokens)
    assert session_codec.SESSION.state(value) == sessions[-1].state


def test_ids_a_tokenizer_would_not_give_back_are_kept_as_ids(tok):
    """A tail whose text tokenizes differently (here: a word split in two) and ids outside the
    vocabulary (a backend's own) are stored as ids; the session still comes back whole."""
    sessions = _episode(tok, turns=2)
    s = sessions[-1]
    split = tok("lookup")["input_ids"]
    assert len(split) == 1  # one token, which the sampler here wrote as its letters
    spelled = [i for c in "lookup" for i in tok(c)["input_ids"]]
    s.turns[1].prompt_token_ids = [*s.turns[1].prompt_token_ids, *spelled]
    s.turns[0].token_ids = [*s.turns[0].token_ids, 10**6]
    s.turns[0].logprobs = [*s.turns[0].logprobs, -0.5]
    codec = session_codec.SessionCodec(TokenizerText(tok))
    value = codec.encode(s)
    assert codec.decode(value) == s
    (frame,) = _bodies(value)
    assert frame.turns[1].prompt_text is None and frame.turns[1].prompt_tail != b""


def test_a_frame_compressed_against_other_frames_does_not_decode(tok, monkeypatch):
    """Each frame after the first is compressed with the earlier frames as zlib's dictionary:
    one spliced after different frames is an error, never a wrong session."""
    monkeypatch.setattr(session_codec, "_APPEND_FROM", 0)
    a = _value(session_codec.SESSION, _episode(tok, seed=1))
    b = _value(session_codec.SESSION, _episode(tok, seed=2))
    first_a = 10 + struct.unpack("<I", a[6:10])[0]
    first_b = 10 + struct.unpack("<I", b[6:10])[0]
    second_a = a[first_a : first_a + 10 + struct.unpack("<I", a[first_a + 6 : first_a + 10])[0]]
    assert second_a[1] == 5  # zlib with the dictionary
    assert session_codec.SESSION.decode(a[: first_a + len(second_a)]).turns  # in place: fine
    moved = second_a[:2] + struct.pack("<I", first_b) + second_a[6:]  # after b's first frame
    with pytest.raises(msgspec.DecodeError):
        session_codec.SESSION.decode(b[:first_b] + moved)
    flipped = second_a[:-1] + bytes([second_a[-1] ^ 1])
    with pytest.raises(msgspec.DecodeError):
        session_codec.SESSION.decode(a[:first_a] + flipped)


class ProsePolicy(Policy):
    """Writes some prose and the environment's reference answer, tokenized with a real BPE
    tokenizer, renders each later prompt as the previous prompt and completion plus the tool
    output's tokens (as the ``hf`` backend continues a conversation), and fails every other
    call, so that every turn resumes from the checkpoint a tokenizer-aware codec wrote."""

    name = "prose"

    def __init__(self, env, tok):
        self.env, self.tok = env, tok
        self.calls: dict[str, int] = {}
        self.produced: dict[tuple[str, int], schema.ModelTurn] = {}

    def session_tokens(self) -> TokenizerText:
        return TokenizerText(self.tok)

    async def respond(self, request: PolicyRequest) -> schema.ModelTurn:
        tid = request.task.task_id
        self.calls[tid] = self.calls.get(tid, 0) + 1
        if self.calls[tid] % 2 == 0:
            raise PolicyError("the sampler went away (a test's crash)")
        rng = random.Random(f"{tid}/{request.turn}")
        thought = " ".join(rng.choices(WORDS, k=25))
        answer = self.env.reference(request.task, request.items, request.state)
        ids = self.tok(thought + "\n" + msgspec.json.encode(answer).decode())["input_ids"]
        prev = request.previous
        if prev is None:
            prompt = self.tok(_chat("user", request.items[-1].content))["input_ids"]
        else:
            said = request.items[-1]
            tail = "\n" + _chat("tool", getattr(said, "output", "")) + "<|im_start|>assistant\n"
            prompt = [*prev.prompt_token_ids, *prev.token_ids, *self.tok(tail)["input_ids"]]
        turn = schema.ModelTurn(
            index=request.turn,
            items=[schema.Reasoning(content=thought), answer],
            prompt_token_ids=prompt,
            token_ids=ids,
            logprobs=[struct.unpack("f", struct.pack("f", -rng.random()))[0] for _ in ids],
            policy_version=3,
        )
        self.produced[(tid, request.turn)] = msgspec.msgpack.decode(
            msgspec.msgpack.encode(turn), type=schema.ModelTurn
        )
        return turn


def test_episodes_resumed_from_tokenizer_packed_checkpoints_reach_the_verifier_exactly(
    tok, redis_url, run_name, monkeypatch
):
    monkeypatch.setattr(session_codec, "_APPEND_FROM", 0)
    cfg = RunConfig(
        run=run_name, env="counter", group_size=2, env_options={"steps": 2},
        rollout=RolloutConfig(max_turns=4),
    )  # fmt: skip
    keys = Keys(run_name)
    sync = redis.Redis.from_url(redis_url)
    ensure_groups(sync, keys)
    sync.set(keys.config, msgspec.msgpack.encode(cfg))
    env = make_env("counter", steps=2)
    Producer(sync, run_name).from_env(env, 1, 2, seed=0)
    policy = ProsePolicy(env, tok)
    seen: list[session_codec._Frame] = []

    async def roll() -> None:
        r = redis.asyncio.Redis.from_url(redis_url)
        lease = _RolloutLease(r, run_name, "W")
        lease.config, lease.keys, lease.table, lease.policy = cfg, keys, EnvTable(cfg), policy
        entries = parse_read(await r.xreadgroup(ROLLOUT_GROUP, "W", {keys.tasks: ">"}, count=9))
        while entries:  # every round: one turn more, from the checkpoint in Redis
            await asyncio.gather(*(lease._episode(e) for e in entries))
            _, entries = parse_claim(
                await lease.scripts.claim(
                    keys=[keys.tasks],
                    args=claim_args(ROLLOUT_GROUP, "W", 0, 9, "0-0", True, keys.session("")),
                )
            )
            seen.extend(f for e in entries for f in _bodies(e.session, e.payload))
        await r.aclose()
        assert lease.counts["finished"] == 2

    asyncio.run(roll())
    assert seen and all(f.tokenizer for f in seen)  # written by the tokenizer-aware codec
    assert any(f.refs for f in seen) and any(t.prompt_text for f in seen for t in f.turns)
    rollouts = [schema.TRAJECTORY.decode(f[b"p"]) for _, f in sync.xrange(keys.rollouts)]
    assert len(rollouts) == 2
    for traj in rollouts:
        assert traj.resumed_from_turn == 2
        for t in traj.turns:
            want = policy.produced[(traj.task_id, t.index)]
            assert t.token_ids == want.token_ids and t.prompt_token_ids == want.prompt_token_ids
            assert array("d", t.logprobs).tobytes() == array("d", want.logprobs).tobytes()
            assert t.items == want.items
    sync.close()


def test_the_first_frame_is_compressed_against_the_task_and_needs_it(tok):
    """The task's payload (the prompt, which Redis holds on the tasks stream) is the first
    frame's dictionary: the session is smaller, and reading it takes those very bytes."""
    sessions = _episode(tok)
    s = sessions[-1]
    task = schema.encode(
        schema.Task(task_id=s.task_id, prompt_id="p3", k=1, group_size=4, env="lookup",
                    input=s.items[:2])
    )  # fmt: skip
    other = task.replace(b"Find the code of Ada.", b"Find the code of Bob.")
    assert other != task
    codec = session_codec.SessionCodec(TokenizerText(tok))
    value = codec.encode(s, task)
    assert codec.decode(value, task) == s
    assert len(value) < len(codec.encode(s)) - 100  # the system and user texts, not again
    assert value[1] == 5  # zlib with a dictionary from the first frame on
    with pytest.raises(msgspec.DecodeError, match="or its task"):
        codec.decode(value)
    with pytest.raises(msgspec.DecodeError):
        codec.decode(value, other)
    assert session_codec.SESSION.state(value, task) == s.state
