"""``nemo-gym``: any NeMo Gym *resources server* as a streamrl environment.

A resources server is an HTTP service: ``POST /seed_session`` starts a rollout's state,
``POST /<tool_name>`` runs one tool, ``POST /verify`` scores the finished rollout, and the
rollout's state lives behind a signed session cookie (Starlette's ``SessionMiddleware``; the
cookie carries a session id, the server keeps the state). This environment speaks that protocol
the way NeMo Gym's own ``simple_agent`` does:

- tasks are NeMo Gym rows (``streamrl produce --dataset rows.jsonl --env nemo-gym``); the model
  sees the row's ``responses_create_params.tools``;
- ``/seed_session`` gets the row (``responses_create_params`` and every other field) before the
  first model turn; each tool call is ``POST /<name>`` with the call's JSON arguments, and the
  response body, as text, is the tool's output; ``/verify`` gets the row plus ``response``, an
  OpenAI ``Response`` whose ``output`` holds the whole episode after the input;
- the cookie jar is part of the episode's state Struct, checkpointed to Redis with the session:
  a rollout worker that dies is replaced by another that resumes with the same cookies. The
  state's journal (``streamrl.envs.external``) checkpoints the seed before the first model turn
  and each tool call before it is sent and after its answer, so a call is never sent twice in
  one session: one whose answer died with a worker (or was lost to a read timeout) costs a
  fresh session into which the confirmed calls are replayed, or, where a replay answers
  differently (or ``replay`` is off), a dead letter. A session given up on is closed with NeMo
  Gym 0.7's ``POST /close_session`` (a 0.4 server answers 404: it stays open, never verified).

Failures. Connection errors, timeouts, 408/425/429/5xx and malformed answers (``/seed_session``
or ``/verify`` not a JSON object, a missing or non-finite ``reward``) are retried ``retries``
times with exponential backoff (a tool call's timeout or broken connection after sending is
not: see above), then raise ``EnvUnavailable`` with the HTTP status and a
snippet of the body: the rollout worker dead-letters the task, the verifier worker retries and
dead-letters the sample. Never a reward of 0. A 4xx answer to a tool call is the model's
mistake (an unknown argument, a bad value): its body goes back to the model as the tool's
output, as NeMo Gym's agent does. A 4xx from ``/seed_session`` or ``/verify`` means the request
itself is wrong for this server: no retry, a failure with the server's message. A ``/verify``
answer with ``mask_sample: true`` (NeMo Gym's way of saying its reward is not a valid
measurement, e.g. a judge was down) is a failure too. (The HTTP client is
``_nemo_gym_http``; its retries are ``streamrl.http.RetryPolicy``.)

The Score keeps the whole ``/verify`` answer in ``info`` except ``responses_create_params`` and
``response``, which are the request echoed back (``BaseVerifyResponse`` extends the request) and
are rebuilt from the trajectory by ``streamrl export --format nemo-gym``. Numeric top-level
fields and ``reward_components`` also go to ``components``, string ones to ``details``.

The scripted policy (tests, benchmarks) replays a row's ``reference_output``: Responses output
items whose model-side items (calls, messages) it emits one per turn; this field is never sent
to the server.

Options: ``base_url`` (required), ``timeout_s`` (30), ``connect_timeout_s`` (5), ``retries``
(3), ``backoff_s`` (0.2), ``backoff_max_s`` (5), ``max_connections`` (256), ``model`` (the
model name written into the ``Response`` sent to ``/verify``), ``verifier_version`` (bump it when
the server's scoring changes, so ``streamrl reverify`` reports the drift), ``rows`` (a NeMo
Gym JSONL file that the generator cycles through, for ``produce --count`` and config runs),
``replay`` (true; false drops a sample whose call was not confirmed instead of replaying it).
"""

from __future__ import annotations

import json
import random
import re
import time
import urllib.parse
from typing import Annotated, Any

import msgspec

from streamrl.defaults import NEMO_GYM_BODY_SNIPPET, NEMO_GYM_REFERENCE_FIELD
from streamrl.envs._nemo_gym_http import (
    Answer,
    ResourcesServer,
    merge_cookies,
    seed_answer,
    snippet,
    verify_answer,
)
from streamrl.envs.base import (
    EnvUnavailable,
    OptionError,
    Prompt,
    StepResult,
    Verdict,
)
from streamrl.envs.external import ExternalSessionEnv, ExternalState, Journal
from streamrl.http import RetryPolicy
from streamrl.responses import input_json, items_from_json, response_json, tools_from_json
from streamrl.schema import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Item,
    Message,
    Task,
    Trajectory,
)

__all__ = [
    "NemoGymEnv",
    "NemoGymState",
    "episode_id",
    "merge_cookies",
    "resources_session_id",
    "verdict_from_answer",
]

# row fields that are streamrl's own and never reach the server
_PRIVATE_FIELDS = frozenset({NEMO_GYM_REFERENCE_FIELD})
# the request, echoed back in every /verify answer (BaseVerifyResponse extends the request)
_ECHOED_FIELDS = frozenset({"responses_create_params", "response"})


class NemoGymState(ExternalState, kw_only=True, omit_defaults=True):
    """What a rollout needs of its server session, checkpointed with the episode (the journal
    of ``streamrl.envs.external`` first)."""

    seeded: bool = False
    cookies: dict[str, str] = msgspec.field(default_factory=dict)  # the session's cookie jar
    seed_response: Any = None  # what /seed_session answered


class NemoGymEnv(ExternalSessionEnv[NemoGymState]):
    name = "nemo-gym"
    version = "1"
    verifier_name = "nemo-gym"
    State = NemoGymState

    class Options(msgspec.Struct, kw_only=True):
        base_url: str = ""
        timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
        connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
        retries: Annotated[int, msgspec.Meta(ge=0, le=20)] = 3
        backoff_s: Annotated[float, msgspec.Meta(ge=0)] = 0.2
        backoff_max_s: Annotated[float, msgspec.Meta(ge=0)] = 5.0
        max_connections: Annotated[int, msgspec.Meta(ge=1)] = 256
        model: str = "streamrl"
        verifier_version: str = "1"
        rows: str = ""  # a NeMo Gym JSONL dataset: the generator cycles through its rows
        replay: bool = True  # false: a call whose answer was lost drops the sample

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        url = str(self.options["base_url"]).rstrip("/")
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise OptionError(
                "environment 'nemo-gym' needs base_url, the resources server's address "
                f"(http://host:port), got {self.options['base_url']!r}: pass "
                "--env-option base_url=http://127.0.0.1:8000"
            )
        self.base_url = url
        o = self.options
        self._server = ResourcesServer(
            url,
            RetryPolicy(o["retries"] + 1, o["backoff_s"], o["backoff_max_s"]),
            timeout_s=o["timeout_s"],
            connect_timeout_s=o["connect_timeout_s"],
            max_connections=o["max_connections"],
        )
        self._rows: list[bytes] | None = None
        self.replay = bool(o["replay"])
        self.recoveries = int(o["retries"])

    @property
    def verifier_id(self) -> tuple[str, str]:
        return (self.verifier_name, str(self.options["verifier_version"]))

    # ---------------------------------------------------------------- the task's row
    def tools_for(self, task: Task) -> list[FunctionTool]:
        return tools_from_json(self._params(task).get("tools"))

    def _params(self, task: Task) -> dict[str, Any]:
        params = task.data.get("responses_create_params") or {}
        if not isinstance(params, dict):
            raise ValueError("responses_create_params must be an object")
        return params

    def row(self, task: Task) -> dict[str, Any]:
        """The NeMo Gym row this task came from, as the server's request models read it."""
        fields = {k: v for k, v in task.data.items() if k not in _PRIVATE_FIELDS}
        params = {**self._params(task), "input": input_json(task.input)}
        return {**fields, "responses_create_params": params}

    def generate(self, rng: random.Random, index: int) -> Prompt:
        """Prompt ``index`` is row ``index % len(rows)`` of the ``rows`` option's file, so
        ``streamrl produce --env nemo-gym --count N`` (and a config-driven run) can cycle a
        NeMo Gym dataset for as many prompts as training takes."""
        from streamrl.responses import row_to_prompt

        if self._rows is None:
            path = str(self.options.get("rows") or "")
            if not path:
                raise NotImplementedError(
                    "nemo-gym generates prompts only from a dataset: set --env-option rows=FILE "
                    "(or push the rows with --dataset)"
                )
            with open(path, "rb") as f:
                self._rows = [line for line in f if line.strip()]
            if not self._rows:
                raise ValueError(f"nemo-gym rows file {path} has no rows")
        line = self._rows[index % len(self._rows)]
        try:
            items, data, _ = row_to_prompt(line)
        except ValueError as e:
            raise ValueError(
                f"{self.options['rows']}: row {index % len(self._rows) + 1}: {e}"
            ) from None
        return Prompt(items, data)

    async def aclose(self) -> None:
        await self._server.aclose()

    # ---------------------------------------------------------------- the episode
    def reset(self, task: Task) -> NemoGymState:
        """An unseeded state: the rollout worker seeds the session under the journal before the
        first model turn (``ExternalSessionEnv.aready``), other callers on first use."""
        self.tools_for(task)  # a row whose tools cannot be read fails here, not mid-episode
        return NemoGymState()

    def decode_state(self, blob: bytes) -> NemoGymState:
        state = super().decode_state(blob)
        if state.seeded and state.journal.phase == "new":  # checkpointed before the journal
            state = msgspec.structs.replace(state, journal=Journal(phase="open", applied=-1))
        return state

    def _seeded(self, state: NemoGymState, answer: Answer) -> NemoGymState:
        return msgspec.structs.replace(
            state, seeded=True, cookies=answer.cookies, seed_response=answer.parsed
        )

    async def aopen(self, task: Task, state: NemoGymState) -> NemoGymState:
        """``POST /seed_session`` with the row and no cookie: a new server session."""
        answer = await self._server.apost("/seed_session", self.row(task), {}, seed_answer)
        return self._seeded(state, answer)

    async def asend(self, task: Task, state: NemoGymState, call: FunctionCall) -> StepResult:
        names = [t.name for t in self.tools_for(task)]
        if call.name not in names:
            known = ", ".join(sorted(names)) or "none"
            return StepResult(f"error: unknown tool {call.name!r} (tools: {known})", state)
        try:
            args = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError as e:
            return StepResult(f"error: arguments are not valid JSON: {e}", state)
        path = "/" + urllib.parse.quote(call.name, safe="")
        answer = await self._server.apost(path, args, state.cookies, tool=True, idempotent=False)
        state = msgspec.structs.replace(state, cookies=answer.cookies)
        return StepResult(answer.body.decode("utf-8", "replace"), state)

    async def aclose_session(self, task: Task, state: NemoGymState) -> bool:
        """``POST /close_session`` as NeMo Gym 0.7 defines it (``resources_session_id``,
        ``episode_id``; idempotent), with the session's cookies. A server without it (NeMo Gym
        0.4) answers 404: the session stays open there, never to be verified."""
        body = {
            "resources_session_id": resources_session_id(task.task_id, state.journal.attempt),
            "episode_id": episode_id(task.task_id, state.journal.attempt),
        }
        answer = await self._server.apost("/close_session", body, state.cookies, tool=True)
        return answer.status < 400

    def call_tool(self, state: NemoGymState, call: FunctionCall) -> StepResult:
        raise NotImplementedError("nemo-gym tools run over HTTP: use acall_tool")

    # ---------------------------------------------------------------- verification
    def verify_request(self, task: Task, trajectory: Trajectory) -> dict[str, Any]:
        """The /verify body: the row, and the episode as an OpenAI ``Response``."""
        params = self._params(task)
        response = response_json(
            f"resp_{trajectory.task_id}",
            trajectory.items[trajectory.n_input :],
            trajectory.started_at or time.time(),
            str(self.options["model"]),
            params.get("tools"),
            parallel_tool_calls=params.get("parallel_tool_calls", True) is not False,
        )
        return {**self.row(task), "response": response}

    def verify(self, task: Task, trajectory: Trajectory, state: NemoGymState) -> Verdict:
        """Not pure, unlike other verifiers: the resources server holds the state it scores."""
        if not state.seeded:  # an episode driven without the async path and with no tool call
            seeded = self._server.post("/seed_session", self.row(task), {}, seed_answer)
            state = self._seeded(state, seeded)
        body = self.verify_request(task, trajectory)
        answer = self._server.post("/verify", body, state.cookies, verify_answer).parsed
        return verdict_from_answer(answer)

    # ---------------------------------------------------------------- scripted reference
    def reference(self, task: Task, items: list[Item], state: NemoGymState) -> Item:
        recorded = task.data.get(NEMO_GYM_REFERENCE_FIELD)
        if not recorded:
            raise NotImplementedError(
                f"this nemo-gym row has no {NEMO_GYM_REFERENCE_FIELD!r} for the scripted policy"
            )
        script = [
            i
            for i in items_from_json(recorded, NEMO_GYM_REFERENCE_FIELD)
            if not isinstance(i, FunctionCallOutput)
        ]
        done = sum(
            1
            for i in items[len(task.input) :]
            if not isinstance(i, FunctionCallOutput)
            and not (isinstance(i, Message) and i.role != "assistant")
        )
        if done < len(script):
            return script[done]
        return Message(role="assistant", content="")


_ROLLOUT_ID_CHAR = re.compile(r"[A-Za-z0-9.-]")


def episode_id(task_id: str, attempt: int) -> dict[str, Any]:
    """NeMo Gym's ``EpisodeId`` of one server session of a sample: ``rollout_id`` is the task
    id written in the characters it allows (any other character, ``_`` included, as ``_`` and
    two hex digits, so that distinct task ids stay distinct; its first character escaped after an
    ``x`` when it is not a letter or digit), ``attempt`` the session's count from 0
    (``Journal.attempt``)."""
    lead = task_id[:1].isascii() and task_id[:1].isalnum()
    out = [] if lead else ["x"]
    for i, ch in enumerate(task_id):
        ok = _ROLLOUT_ID_CHAR.fullmatch(ch) and (i > 0 or lead)
        out.append(ch if ok else "".join(f"_{b:02x}" for b in ch.encode()))
    rollout = "".join(out)
    if re.search(r"-a[1-9][0-9]*$", rollout):  # EpisodeId reserves that suffix
        rollout += "_"
    return {"rollout_id": rollout, "attempt": attempt}


def resources_session_id(task_id: str, attempt: int) -> str:
    """The id streamrl gives a sample's server session: ``EpisodeId.capture_key``."""
    rollout = episode_id(task_id, attempt)["rollout_id"]
    return rollout if attempt == 0 else f"{rollout}-a{attempt}"


def verdict_from_answer(answer: dict[str, Any]) -> Verdict:
    """A /verify answer as a Verdict, every field kept (see the module's docstring)."""
    if answer.get("mask_sample") is True:
        raise EnvUnavailable(
            "/verify masked the sample (its reward is not a valid measurement): "
            f"failure_kind={answer.get('failure_kind')!r}, "
            f"failure_reason={snippet(str(answer.get('failure_reason')))!r}"
        )
    components: dict[str, float] = {}
    details: dict[str, str] = {}
    info: dict[str, Any] = {}
    for key, value in answer.items():
        if key == "reward" or key in _ECHOED_FIELDS:
            continue
        info[key] = value
        if isinstance(value, int | float) and not isinstance(value, bool):
            components[key] = float(value)
        elif isinstance(value, str):
            details[key] = value[:NEMO_GYM_BODY_SNIPPET]
    rc = answer.get("reward_components")
    if isinstance(rc, dict):
        for key, value in rc.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                components[f"reward_components.{key}"] = float(value)
    return Verdict(
        reward=float(answer["reward"]), components=components, details=details, info=info
    )
