"""The environment API.

An environment owns the tools a model may call, the per-episode state (a msgspec Struct, so it
can be checkpointed to Redis after every turn), how that state changes, and optionally how the
environment answers a plain assistant message (games, simulated users). Nothing lives in worker
memory between turns: every method is a function of (task, state, input) -> (output, state).
"""

from __future__ import annotations

import json
import random
import re
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

import msgspec

from streamrl.envs.toolschema import validate_arguments
from streamrl.schema import FunctionCall, FunctionTool, Item, Message, Task, Trajectory
from streamrl.verifiers.verdict import Verdict

S = TypeVar("S", bound=msgspec.Struct)


class Prompt(NamedTuple):
    """What a generator makes: the opening conversation and the data the verifier needs."""

    input: list[Item]
    data: dict[str, Any]


class StepResult(NamedTuple):
    output: str
    state: Any
    # The call ended the episode (an answer was submitted): no further model turn. Calls
    # after it in the same model turn are not run.
    done: bool = False


class ReplyResult(NamedTuple):
    message: str | None  # None: the environment has nothing to say
    done: bool
    state: Any


class ToolError(Exception):
    """Raised by a tool for a mistake the model made; the message goes back to the model."""


class EnvUnavailable(Exception):
    """The service behind an environment failed (connection, timeout, 5xx, a malformed answer)
    after its retries: infrastructure, never the model's fault. A rollout dead-letters its task
    with this message, a verifier's failure is dead-lettered with it; it is never a reward."""


class SampleMasked(EnvUnavailable):
    """The environment scored the sample and said the score is not a valid measurement (NeMo
    Gym's ``mask_sample: true``: a judge that failed, a lost sandbox). Dead-lettered at once as
    an environment failure, counted by ``kind``; never a reward, never retried."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"the environment masked the sample ({kind}): {reason}")
        self.kind = kind
        self.reason = reason


class OptionError(ValueError):
    """An environment option that the environment does not have, or a value it cannot take."""


class NoOptions(msgspec.Struct):
    pass


class Environment(Generic[S]):
    """Subclass, set ``name``, ``State`` and ``tools``, and implement the methods you need."""

    name: ClassVar[str] = ""
    version: ClassVar[str] = "1"
    # The verifier's identity stamped on every Score; bump the version whenever scoring changes
    # so that re-verifying stored trajectories yields a drift report.
    verifier_name: ClassVar[str] = ""
    verifier_version: ClassVar[str] = ""
    State: ClassVar[type[msgspec.Struct]]
    tools: ClassVar[list[FunctionTool]] = []
    # The highest reward ``verify`` can give: the audit checks that the reference agent gets it.
    max_reward: ClassVar[float] = 1.0

    # The options this environment takes (``--env-option``, ``env_options``): a Struct whose
    # fields give each option's type, default and range, so a typo or a bad value is refused
    # where it enters instead of being ignored. ``None`` takes any options unchecked (for
    # environments written before options were declared).
    Options: ClassVar[type[msgspec.Struct] | None] = NoOptions

    def __init__(self, **options: Any) -> None:
        self.options = self.check_options(options)
        self._state_decoder = msgspec.msgpack.Decoder(self.State)
        self._tools_by_name = {t.name: t for t in self.tools}

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        """The options with their declared defaults filled in, or OptionError saying which
        option is wrong and what is allowed."""
        if cls.Options is None:
            return dict(options)
        known = cls.Options.__struct_fields__
        unknown = sorted(set(options) - set(known))
        label = cls.name or cls.__name__
        if unknown:
            raise OptionError(
                f"environment {label!r} has no option {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(known) or 'none'}"
            )
        try:
            return msgspec.structs.asdict(msgspec.convert(options, cls.Options, strict=False))
        except msgspec.ValidationError as e:
            msg, _, where = str(e).partition(" - at `$.")
            name = where.split("`")[0].split(".")[0].split("[")[0]
            if name in options:
                msg = f"{name}={options[name]!r}: {msg}"
            raise OptionError(f"environment {label!r} option {msg}") from None

    def tools_for(self, task: Task) -> list[FunctionTool]:
        """The tools the model sees in this task: the class's ``tools`` unless the task brings
        its own (a NeMo Gym row's ``responses_create_params.tools``)."""
        return self.tools

    # -- tasks
    def generate(self, rng: random.Random, index: int) -> Prompt:
        raise NotImplementedError(f"environment {self.name!r} has no task generator")

    def same_prompt_key(self, prompt: Prompt) -> Any:
        """What makes two generated prompts the same prompt when held-out prompts are kept
        apart from training ones: the conversation the model is shown. Override when the
        model must discover part of the task through tools (``lookup``'s codes), so that two
        prompts with the same words are still different tasks."""
        return prompt.input

    # -- episode
    def reset(self, task: Task) -> S:
        raise NotImplementedError

    def step(self, state: S, name: str, arguments: dict[str, Any]) -> StepResult:
        """Run one tool call whose arguments already match the tool's JSON schema."""
        raise NotImplementedError(f"environment {self.name!r} has no tools")

    def reply(self, state: S, message: str) -> ReplyResult:
        """Answer a plain assistant message. Default: the message ends the episode."""
        return ReplyResult(None, True, state)

    # -- verification
    def verify(self, task: Task, trajectory: Trajectory, state: S) -> Verdict:
        """A pure function of its arguments: it never reads worker memory or the network."""
        raise NotImplementedError

    @property
    def verifier_id(self) -> tuple[str, str]:
        return (self.verifier_name or self.name, self.verifier_version or self.version)

    def release(self, task: Task, trajectory: Trajectory, state: S) -> None:
        """A sample the verifier worker dead-letters (its verification kept failing): release
        what it holds on a server (``nemo-gym`` closes its session). Best effort; default:
        nothing."""

    # -- a reference agent: drives the scripted policy and the audit's reference check
    def reference(self, task: Task, items: list[Item], state: S) -> Item:
        raise NotImplementedError(f"environment {self.name!r} has no reference agent")

    def wrong(self, task: Task, items: list[Item], state: S) -> Item:
        """A plausible *wrong* agent's next action: the audit's baseline, which no cheating
        answer may out-score. Default: the reference's action, with a final answer's last
        integer changed (see ``perturb_answer``); override when that is not wrong enough."""
        item = self.reference(task, items, state)
        if isinstance(item, Message) and item.role == "assistant":
            return Message(role="assistant", content=perturb_answer(item.content))
        return item

    # -- the episode as the rollout worker drives it: environments whose steps wait on a
    # service (HTTP) override these so that a worker's concurrent episodes do not block
    # each other; the defaults run the plain methods.
    async def areset(self, task: Task) -> S:
        return self.reset(task)

    async def acall_tool(self, task: Task, state: S, call: FunctionCall) -> StepResult:
        return self.call_tool(state, call)

    async def aclose(self) -> None:
        """Release what the async methods opened (a connection pool) at a lease's end."""

    # -- an environment that drives its own episodes (an agent of its own calls the policy
    # over HTTP: nemo-gym mode=run), instead of the worker's agent loop
    serves_episodes: bool = False
    endpoint_address: tuple[str, int] = ("127.0.0.1", 0)  # where the worker serves its policy

    async def arun_served(self, task: Task, state: S, endpoint: Any, save: Any) -> Any:
        """Run the episode with the worker's policy served at ``endpoint``
        (``streamrl.policy.endpoint.PolicyEndpoint``: ``open`` the episode's key, let the
        driver call it, ``close`` it), checkpointing ``state`` through ``save`` before each
        attempt; returns ``(items, turns, state)``. Only when ``serves_episodes``."""
        raise NotImplementedError

    # -- plumbing the workers use
    def encode_state(self, state: S) -> bytes:
        return msgspec.msgpack.encode(state)

    def decode_state(self, blob: bytes) -> S:
        return self._state_decoder.decode(blob)

    def malformed(self, call: FunctionCall) -> str | None:
        """What is wrong with a call before any tool runs (an unknown tool, arguments that are
        not JSON or do not match the tool's schema), or None: the error the model is shown,
        and what evaluation counts as a malformed call."""
        tool = self._tools_by_name.get(call.name)
        if tool is None:
            known = ", ".join(sorted(self._tools_by_name)) or "none"
            return f"unknown tool {call.name!r} (tools: {known})"
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError as e:
            return f"arguments are not valid JSON: {e}"
        problem = validate_arguments(tool.parameters, args)
        return f"invalid arguments for {call.name}: {problem}" if problem else None

    def call_tool(self, state: S, call: FunctionCall) -> StepResult:
        """A model's tool call, checked: unknown tools, unparsable JSON and arguments that do
        not match the schema come back to the model as an error output, never an exception."""
        problem = self.malformed(call)
        if problem:
            return StepResult(f"error: {problem}", state)
        args = json.loads(call.arguments) if call.arguments.strip() else {}
        try:
            return self.step(state, call.name, args)
        except ToolError as e:
            return StepResult(f"error: {e}", state)
        except Exception as e:  # a broken tool must not crash the episode or the worker
            return StepResult(f"error: tool {call.name} raised {type(e).__name__}: {e}", state)


def perturb_answer(text: str) -> str:
    """``text`` with its last integer increased by one (or prefixed with "not" if it has none):
    the cheapest answer that is wrong for any environment whose answer is a number."""
    matches = list(re.finditer(r"\d+", text))
    if not matches:
        return f"not {text}"
    m = matches[-1]
    return f"{text[: m.start()]}{int(m.group()) + 1}{text[m.end() :]}"


def last_assistant_text(items: list[Item]) -> str:
    for item in reversed(items):
        if isinstance(item, Message) and item.role == "assistant":
            return item.content
    return ""


def user(text: str) -> Message:
    return Message(role="user", content=text)
