"""``nemo-gym``: any NeMo Gym *resources server* as a streamrl environment, or (``mode=run``)
a NeMo Gym 0.7 *environment server* that drives the episode itself (``_nemo_gym_run``).

Kept whole: the two seed protocols, the journal's hooks, verification and both modes share one
set of options, the row and the state; the HTTP client, the wire values and ``/run`` are in
``_nemo_gym_http``, ``_nemo_gym_wire`` and ``_nemo_gym_run``.

A resources server is an HTTP service: ``POST /seed_session`` starts a rollout's state,
``POST /<tool_name>`` runs one tool, ``POST /verify`` scores the finished rollout, and (NeMo Gym
0.7) ``POST /close_session`` ends it; the rollout's state lives behind a signed session cookie.
This environment drives it the way NeMo Gym's own agents do, the rollout worker being the agent:

- tasks are NeMo Gym rows (``streamrl produce --dataset rows.jsonl --env nemo-gym``); the model
  sees the row's ``responses_create_params.tools``;
- the session is seeded before the first model turn. Both protocols, found on the first seed,
  not configured: the typed body of 0.7 (``resources_session_id``, ``episode_id: {rollout_id,
  attempt}``, ``task_id: {taskset, task_id}``, the row as ``task_data``), which a 0.7 server
  echoes; a server that answers it 422 or without the echo reads the legacy body (the row,
  NeMo Gym 0.4) and gets that from then on. ``attempt`` counts the sample's server sessions
  (``Journal.attempt``): a session redone after a worker kill is the next attempt, never a
  silent second session under the same id;
- each tool call is ``POST /<name>`` with the call's JSON arguments, and the response body, as
  text, is the tool's output; ``/verify`` gets the row plus ``response``, an OpenAI
  ``Response`` whose ``output`` holds the whole episode after the input; then the session is
  closed. A 0.4 server answers ``/close_session`` 404: it is not asked again;
- the cookie jar is part of the episode's state, checkpointed with the session, under the
  write-ahead journal of ``streamrl.envs.external``: a call is never sent twice in one session
  (one whose answer died with a worker costs a fresh session into which the confirmed calls
  are replayed, or a dead letter), and every session an attempt abandons is closed, the one
  whose seed answer was lost by its id (typed seeds only).

Failures. Connection errors, timeouts, 408/425/429/5xx and malformed answers (``/seed_session``
or ``/verify`` not a JSON object, a missing or non-finite ``reward``) are retried ``retries``
times with exponential backoff (a tool call's timeout or broken connection after sending is
not: see above), then raise ``EnvUnavailable`` with the HTTP status and a snippet of the body:
the rollout worker dead-letters the task, the verifier worker retries and dead-letters the
sample. Never a reward of 0. A 4xx answer to a tool call is the model's mistake: its body goes
back to the model as the tool's output, as NeMo Gym's agent does. Another 4xx from
``/seed_session`` or ``/verify`` is a failure with the server's message, not retried. A
``/verify`` answer with ``mask_sample: true`` (a judge that failed answers ``reward 0.0`` and
the mask) is ``SampleMasked``: dead-lettered at once with its ``failure_kind`` and reason.

The Score keeps the whole ``/verify`` answer in ``info`` (``reward_components`` included) except
the request it echoes (``responses_create_params``, ``response``), which ``streamrl export
--format nemo-gym`` rebuilds. Numeric fields and each ``reward_components`` entry also go to
``components``, string ones to ``details``. The scripted policy (tests, benchmarks) replays a
row's ``reference_output`` (Responses output items), a field never sent to the server.

Options: ``base_url`` (required), ``timeout_s`` (30), ``connect_timeout_s`` (5), ``retries``
(3), ``backoff_s`` (0.2), ``backoff_max_s`` (5), ``max_connections`` (256), ``model`` (the
model name written into the ``Response`` sent to ``/verify``), ``verifier_version`` (bump it when
the server's scoring changes, so ``streamrl reverify`` reports the drift), ``taskset`` (the
typed seed's ``task_id.taskset``, "streamrl"), ``rows`` (a NeMo Gym JSONL file that the
generator cycles through), ``replay`` (true; false drops a sample whose call was not confirmed
instead of replaying it), ``mode`` (``resources``; ``run``: ``base_url`` is an environment
server), ``policy_endpoint`` (mode=run: the ``host:port`` the rollout worker serves its policy
on, which the environment server's agent calls as its model server; ``127.0.0.1:0``),
``run_timeout_s`` (mode=run: one whole ``/run``, 600).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.parse
from typing import Annotated, Any, Literal

import msgspec
import structlog

from streamrl.defaults import NEMO_GYM_REFERENCE_FIELD, NEMO_GYM_TASKSET
from streamrl.envs._nemo_gym_http import (
    Answer,
    ResourcesServer,
    merge_cookies,
    seed_answer,
    verify_answer,
)
from streamrl.envs._nemo_gym_run import RunClient, arun
from streamrl.envs._nemo_gym_wire import (
    close_body,
    episode_id,
    resources_session_id,
    seeds_typed,
    took_typed,
    typed_seed_body,
    verdict_from_answer,
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

log = structlog.get_logger("streamrl.envs.nemo_gym")

# row fields that are streamrl's own and never reach the server
_PRIVATE_FIELDS = frozenset({NEMO_GYM_REFERENCE_FIELD})


class NemoGymState(ExternalState, kw_only=True, omit_defaults=True):
    """What a rollout needs of its server session, checkpointed with the episode (the journal
    of ``streamrl.envs.external`` first)."""

    seeded: bool = False
    cookies: dict[str, str] = msgspec.field(default_factory=dict)  # the session's cookie jar
    seed_response: Any = None  # what /seed_session answered
    # the seed: "typed" (0.7's, the id below echoed back), "legacy" (the row, as 0.4), "" (old)
    protocol: str = ""
    resources_session_id: str = ""
    # mode=run (an environment server drives the episode, ``_nemo_gym_run``): "running" is
    # checkpointed before /run is sent, "done" with its result
    run_phase: str = ""
    run_result: Any = None
    run_redone: int = 0  # attempts given up because the worker running them died
    run_failures: list[str] = msgspec.field(default_factory=list)  # attempts that failed


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
        taskset: str = NEMO_GYM_TASKSET
        rows: str = ""  # a NeMo Gym JSONL dataset: the generator cycles through its rows
        replay: bool = True  # false: a call whose answer was lost drops the sample
        # "resources": the worker is the agent of a resources server (base_url); "run": base_url
        # is a NeMo Gym 0.7 environment server whose agent calls the worker's policy endpoint
        mode: Literal["resources", "run"] = "resources"
        policy_endpoint: str = "127.0.0.1:0"  # where the worker serves its policy (mode=run)
        run_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 600.0  # one /run, whole episode

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
        # the server's seed protocol, found on the first seed ("typed" or "legacy"), and
        # whether it has /close_session (a 0.4 server answers 404: not asked again)
        self._protocol = ""
        self._closes = True
        self._lock: tuple[Any, asyncio.Lock] | None = None  # (its event loop, the lock)
        self.replay = bool(o["replay"])
        self.recoveries = int(o["retries"])
        self._run = RunClient(url, o) if o["mode"] == "run" else None  # mode=run's /run
        self.serves_episodes = self._run is not None

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
        if self._run is not None:
            await self._run.server.aclose()

    @property
    def endpoint_address(self) -> tuple[str, int]:  # type: ignore[override]
        """mode=run: where the rollout worker serves its policy (``policy_endpoint``)."""
        assert self._run is not None
        return self._run.address

    async def arun_served(self, task: Task, state: NemoGymState, endpoint: Any, save: Any):
        """mode=run: the environment server drives the episode (``_nemo_gym_run``)."""
        assert self._run is not None
        return await arun(self, self._run, task, state, endpoint, save)

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

    def _seeded(self, state: NemoGymState, answer: Answer, body: dict) -> NemoGymState:
        return msgspec.structs.replace(
            state,
            seeded=True,
            cookies=answer.cookies,
            seed_response=answer.parsed,
            protocol="typed" if "episode_id" in body else "legacy",
            resources_session_id=str(body.get("resources_session_id", "")),
        )

    async def aopen(self, task: Task, state: NemoGymState) -> NemoGymState:
        """``POST /seed_session`` with no cookie: a new server session, seeded with the typed
        body (NeMo Gym 0.7) unless the server showed it reads only the row (0.4): see
        ``took_typed``. A session the server made from a typed body it read as a legacy one
        is closed where it can be, and seeded again with the row."""
        if not self._protocol:  # one seed finds it while the episodes of this loop wait
            loop = asyncio.get_running_loop()
            if self._lock is None or self._lock[0] is not loop:
                self._lock = (loop, asyncio.Lock())
            async with self._lock[1]:
                if not self._protocol:
                    return await self._aseed(task, state)
        return await self._aseed(task, state)

    async def _aseed(self, task: Task, state: NemoGymState) -> NemoGymState:
        if self._protocol != "legacy":
            taskset = str(self.options["taskset"])
            body = typed_seed_body(task, state.journal.attempt, taskset, self.row(task))
            answer = await self._server.apost("/seed_session", body, {}, seed_answer, tool=True)
            took = took_typed(answer, body, self._protocol == "typed")
            self._protocol = "typed" if took else "legacy"
            if took:
                return self._seeded(state, answer, body)
            if answer.status < 400 and self._closes:
                await self._aclose(body, answer.cookies)
        row = self.row(task)
        answer = await self._server.apost("/seed_session", row, {}, seed_answer)
        return self._seeded(state, answer, row)

    async def _aschema_protocol(self) -> str:
        """Whether the server's OpenAPI schema (FastAPI serves it) says ``/seed_session`` takes
        0.7's ``ResourcesSeedSessionRequest`` ("typed"; "" unknown): a probe with no effect."""
        return "typed" if seeds_typed(await self._server.aget_json("/openapi.json")) else ""

    def _closed(self, answer: Answer) -> bool:
        if answer.status in (404, 405):  # no /close_session here (NeMo Gym 0.4)
            self._closes = False
        return answer.status < 400

    async def _aclose(self, body: dict[str, Any], cookies: dict[str, str]) -> bool:
        close = {k: body[k] for k in ("resources_session_id", "episode_id")}
        answer = await self._server.apost("/close_session", close, cookies, tool=True)
        return self._closed(answer)

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
        body = close_body(task.task_id, state.journal.attempt)
        return self._closes and await self._aclose(body, state.cookies)

    async def aclose_unconfirmed(self, task: Task, state: NemoGymState) -> bool:
        """A typed seed named its session: it is closed by that id (no cookie; a 0.7 server
        keeps a late seed of a closed id from making it again). Only for a server known to
        take typed seeds: a close by an id that a legacy seed never bound would close nothing
        and answer 200."""
        if not self._protocol:  # no seed answered in this process yet: ask the schema
            self._protocol = await self._aschema_protocol()
        if self._protocol != "typed" or not self._closes:
            return False
        try:
            return await self._aclose(close_body(task.task_id, state.journal.attempt), {})
        except EnvUnavailable as e:
            log.warning("closing an unconfirmed session failed", task_id=task.task_id, error=str(e))
            return False

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
        """Not pure, unlike other verifiers: the resources server holds the state it scores.
        An episode an environment server ran (mode=run) is scored by its ``/run`` result."""
        if state.run_result is not None:
            return verdict_from_answer(state.run_result)
        if not state.seeded:  # an episode driven without the async path and with no tool call
            row = self.row(task)  # the legacy body: this path is not checkpointed anyway
            seeded = self._server.post("/seed_session", row, {}, seed_answer)
            state = self._seeded(state, seeded, row)
        body = self.verify_request(task, trajectory)
        answer = self._server.post("/verify", body, state.cookies, verify_answer).parsed
        self._close_verified(task, state)
        return verdict_from_answer(answer)

    def release(self, task: Task, trajectory: Trajectory, state: NemoGymState) -> None:
        """A sample dead-lettered at the verifier stage (``/verify`` kept failing, or its
        rollout failed): its session is closed, as after a verify (an environment server closes
        its own, mode=run)."""
        if state.run_result is None and state.seeded:
            self._close_verified(task, state)

    def _close_verified(self, task: Task, state: NemoGymState) -> None:
        """``/close_session`` once ``/verify`` has answered: the session is done. Best effort
        (a session left open is a leak, not a wrong reward). A verification redone after this
        (a verifier worker that died before writing the score) finds the session closed: the
        server refuses it and the sample is dead-lettered, never scored from a fresh session."""
        if not self._closes:
            return
        try:
            answer = self._server.post(
                "/close_session", close_body(task.task_id, state.journal.attempt), state.cookies,
                tool=True,
            )  # fmt: skip
            self._closed(answer)
        except EnvUnavailable as e:
            log.warning("closing a verified session failed", task_id=task.task_id, error=str(e))

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
