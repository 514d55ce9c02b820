"""Wire formats: every payload that crosses Redis is one of these Structs, msgpack-encoded.

Decoding with the typed decoders below is also validation; a payload that does not decode is
dead-lettered with the decoder's message. Every top-level payload carries ``v``, the schema
version, so a reader can reject what it does not understand instead of misreading it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

import msgspec

from streamrl.defaults import SCHEMA_VERSION


class _Base(msgspec.Struct, kw_only=True, omit_defaults=True):
    pass


# ---------------------------------------------------------------- Responses API items


class Message(_Base, kw_only=True, tag="message", tag_field="type"):
    """A chat message; ``content`` is plain text (Responses content parts are flattened)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str


class FunctionCall(_Base, kw_only=True, tag="function_call", tag_field="type"):
    call_id: str
    name: str
    arguments: str  # JSON text, as the model wrote it: it may not parse.


class FunctionCallOutput(_Base, kw_only=True, tag="function_call_output", tag_field="type"):
    call_id: str
    output: str


class Reasoning(_Base, kw_only=True, tag="reasoning", tag_field="type"):
    content: str


Item = Message | FunctionCall | FunctionCallOutput | Reasoning


class FunctionTool(_Base, kw_only=True, tag="function", tag_field="type"):
    """A Responses API function tool: what the model sees of an environment's tool."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)


# ---------------------------------------------------------------- pipeline payloads


def _check_slot(obj: Any) -> None:
    """A sample's place in its group; an entry outside it could never join a group, and the
    group-assembly script would index a slot that does not exist."""
    if not obj.task_id or not obj.prompt_id:
        raise ValueError("task_id and prompt_id must be non-empty")
    if obj.group_size < 1:
        raise ValueError(f"group_size must be at least 1, got {obj.group_size}")
    if not 0 <= obj.k < obj.group_size:
        raise ValueError(f"k must be in [0, group_size={obj.group_size}), got {obj.k}")


class Task(_Base, kw_only=True):
    """One sample to roll out: ``task_id = f"{prompt_id}:{k}"``, ``k < group_size``."""

    v: int = SCHEMA_VERSION
    task_id: str
    prompt_id: str
    k: int
    group_size: int
    env: str
    input: list[Item]
    data: dict[str, Any] = msgspec.field(default_factory=dict)  # env-specific, env validates it
    seed: int = 0
    created_at: float = 0.0

    def __post_init__(self) -> None:
        _check_slot(self)


class ModelTurn(_Base, kw_only=True):
    """What the policy did in one turn, with what the learner needs to train on it."""

    index: int
    items: list[Item]
    prompt_token_ids: list[int] = msgspec.field(default_factory=list)
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[float] = msgspec.field(default_factory=list)
    policy_version: int = 0
    finish_reason: str = "stop"
    worker: str = ""
    seconds: float = 0.0


TrajectoryStatus = Literal["completed", "truncated", "failed"]


class Session(_Base, kw_only=True):
    """An episode in flight, checkpointed to ``session:<task_id>`` after every turn."""

    v: int = SCHEMA_VERSION
    task_id: str
    items: list[Item]
    turns: list[ModelTurn] = msgspec.field(default_factory=list)
    state: bytes = b""  # the environment's state Struct, msgpack-encoded by the environment
    tokens: int = 0
    started_at: float = 0.0
    tool_seconds: float = 0.0
    claims: int = 1  # how many workers have held this episode
    resumed_from_turn: int = -1  # turn count when last resumed by another worker, -1 if never


class Trajectory(_Base, kw_only=True):
    v: int = SCHEMA_VERSION
    task_id: str
    prompt_id: str
    k: int
    group_size: int
    env: str
    items: list[Item]  # the task's input items first (``n_input`` of them), then the episode
    n_input: int = 0
    turns: list[ModelTurn]
    status: TrajectoryStatus
    failure: str | None = None
    state: bytes = b""
    data: dict[str, Any] = msgspec.field(default_factory=dict)
    started_at: float = 0.0
    finished_at: float = 0.0
    tool_seconds: float = 0.0
    worker: str = ""
    attempt: int = 1
    resumed_from_turn: int = -1

    def __post_init__(self) -> None:
        _check_slot(self)

    @property
    def policy_versions(self) -> list[int]:
        return sorted({t.policy_version for t in self.turns})

    def task(self) -> Task:
        """The task this trajectory answers, as the verifier sees it."""
        return Task(
            task_id=self.task_id,
            prompt_id=self.prompt_id,
            k=self.k,
            group_size=self.group_size,
            env=self.env,
            input=self.items[: self.n_input],
            data=self.data,
        )


class Score(_Base, kw_only=True):
    """A verifier's verdict. ``reward is None`` exactly when ``failure`` says why."""

    v: int = SCHEMA_VERSION
    task_id: str
    prompt_id: str
    k: int
    reward: float | None
    components: dict[str, float] = msgspec.field(default_factory=dict)
    details: dict[str, str] = msgspec.field(default_factory=dict)
    # Anything else the verifier answered, as JSON values: a NeMo Gym resources server's whole
    # /verify answer (``failure_kind``, its own metrics, ...). Omitted when empty, so Scores
    # written before it existed decode unchanged.
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    verifier: str = ""
    verifier_version: str = ""
    failure: str | None = None
    # the environment's name for the failure, as the dead letter's ``kind``:
    # ``masked:<failure_kind>`` for a sample it masked (NeMo Gym's ``mask_sample``)
    failure_kind: str = ""
    rollout_id: str = ""
    policy_versions: list[int] = msgspec.field(default_factory=list)
    worker: str = ""
    scored_at: float = 0.0
    env: str = ""  # the trajectory's environment: the live feed's label (`streamrl metrics`)


class Sample(_Base, kw_only=True):
    """One scored trajectory as it sits inside a Group."""

    score: Score
    trajectory: Trajectory


class Group(msgspec.Struct, array_like=True):
    """All samples of one prompt: the unit of GRPO.

    Array-like on the wire because the group-assembly Lua script writes it by concatenating
    the header fields with the samples' own msgpack bytes (see ``bus/scripts.py``).
    """

    v: int
    prompt_id: str
    group_size: int
    reward_mean: float
    reward_std: float  # population std of the rewards; the learner computes its own advantages
    samples: list[Sample]

    def __post_init__(self) -> None:
        if self.group_size < 1 or len(self.samples) != self.group_size:
            raise ValueError(
                f"a group of size {self.group_size} must hold that many samples, "
                f"holds {len(self.samples)}"
            )


class PolicyVersion(_Base, kw_only=True):
    """One announced policy version. ``digests`` maps each file under ``path`` (relative name)
    to its sha256 hex digest; a rollout worker refuses files that do not match
    (``streamrl.policy.integrity``). Empty in announcements older than the field: loaded
    unchecked."""

    v: int = SCHEMA_VERSION
    version: int
    step: int = 0
    path: str = ""
    format: Literal["safetensors", "lora", "none"] = "safetensors"
    created_at: float = 0.0
    digests: dict[str, str] = msgspec.field(default_factory=dict)


class WorkerPolicy(_Base, kw_only=True):
    """One rollout worker's policy health, in the run's ``policy_health`` hash (field: the
    worker's consumer name), rewritten on every heartbeat of its lease. ``behind_since`` is
    when it last fell more than ``max_staleness`` versions behind ``newest`` (None while it is
    not); a record not rewritten for ``3 * heartbeat_s + 10`` seconds belongs to no live lease."""

    v: int = SCHEMA_VERSION
    worker: str
    backend: str = ""
    version: int = 0  # the policy version this worker serves
    newest: int | None = None  # the newest version announced on the policy stream
    error: str | None = None  # the backend's last reload error; None: the last reload worked
    behind_since: float | None = None  # wall time
    max_staleness: int = 0
    heartbeat_s: float = 0.0
    fault: str | None = None  # the run fault this worker raised, until it is healthy again
    updated_at: float = 0.0
    server: str = ""  # the policy server it talks to ('' in-process)
    in_flight: int = 0  # its requests on that server at the heartbeat
    waiting: int = 0  # its requests waiting for a slot of that server (max_inflight_per_server)


class DeadLetter(_Base, kw_only=True):
    """Why an entry left its stage for good."""

    v: int = SCHEMA_VERSION
    stage: str
    entry_id: str
    reason: str
    deliveries: int = 0
    task_id: str = ""
    payload: bytes = b""
    at: float = 0.0
    # the environment's name for the failure: ``masked:<failure_kind>`` for a sample whose
    # score the environment masked (NeMo Gym's ``mask_sample``); "" for the others
    kind: str = ""


class JudgeAnswer(_Base, kw_only=True):
    """An LLM judge's parsed answer, as its cache keeps it (``judge:cache:<version>:<digest>``):
    what it was asked, what it said, the grade read from that."""

    v: int = SCHEMA_VERSION
    prompt: str
    raw: str
    score: float


# ---------------------------------------------------------------- codecs, built once per type

_encoder = msgspec.msgpack.Encoder()
TASK = msgspec.msgpack.Decoder(Task)
PLAIN_SESSION = msgspec.msgpack.Decoder(Session)  # the form before the packed one
TRAJECTORY = msgspec.msgpack.Decoder(Trajectory)
SCORE = msgspec.msgpack.Decoder(Score)
GROUP = msgspec.msgpack.Decoder(Group)
POLICY_VERSION = msgspec.msgpack.Decoder(PolicyVersion)
DEAD_LETTER = msgspec.msgpack.Decoder(DeadLetter)
WORKER_POLICY = msgspec.msgpack.Decoder(WorkerPolicy)
JUDGE_ANSWER = msgspec.msgpack.Decoder(JudgeAnswer)


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def check_version(obj: Any) -> Any:
    """Reject payloads from a newer schema rather than misread them."""
    if obj.v > SCHEMA_VERSION:
        raise msgspec.ValidationError(
            f"schema version {obj.v} is newer than this streamrl understands ({SCHEMA_VERSION})"
        )
    return obj


def now() -> float:
    return time.time()
