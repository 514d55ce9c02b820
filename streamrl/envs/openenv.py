"""``openenv``: an OpenEnv environment server (PyPI ``openenv-core``; the standard behind TRL's
``environment_factory``) as a streamrl environment, driven over its WebSocket session protocol.

An OpenEnv server holds one environment instance per WebSocket connection (``/ws``): ``reset``
gives the first observation, each ``step`` takes an action (a JSON object matching the
server's action schema, ``GET /schema``) and answers ``{"observation", "reward", "done"}``;
``state`` answers the session's ``episode_id`` and ``step_count``. The model sees one tool,
``step`` (its parameters are the action schema), and each step's observation as the tool's
output; an observation with ``done`` ends the episode, a plain assistant message too.

- **Exactly once, across worker deaths.** A session lives as long as its connection, so a
  rollout worker that dies takes its session with it: the server destroys it. The episode's
  write-ahead journal (``streamrl/envs/external.py``, as ``nemo-gym`` uses it) makes the
  worker that takes the episode over open a fresh session (``reset`` with the same arguments)
  and replay into it the actions whose observations were checkpointed, comparing each
  observation (and the first) with the recorded one: an environment that does not reproduce its
  episode is dropped as an infrastructure failure (a dead letter), never guessed at. A step
  sent and not confirmed is never sent again into the session it may have reached (that
  session is gone); it is sent again, once, after the replay, as the model asked. OpenEnv has no
  way to reattach to a session, so nothing is resumed in place.
- **Failures stay failures.** A server that cannot be reached, refuses the session (its
  ``max_concurrent_envs`` reached, after waiting ``capacity_wait_s``), answers a step with an
  execution error (the environment raised) or with a malformed message is retried where that
  is safe and then dead-lettered; never scored. An action that does not validate against the
  action schema is the model's mistake: the server's errors are the tool's output.
- **The score** is the sum of the step rewards (``reward = "last"``: the last step's), computed
  by the verifier worker from the rewards the episode recorded; ``Score.info`` keeps each
  step's reward, the session's final ``state`` (``step_count`` counts the steps the server
  applied in the session that finished the episode) and the journal's counts.

Prompts come from a dataset (rows with ``prompt``; a ``reset`` field gives that row's reset
arguments, e.g. a seed; ``reference_actions`` drives the scripted policy and the audit) or from
the server itself (``produce --env openenv --count N``: the reset observation with
``{"seed": i}`` after the ``prompt`` option's text). Options: ``base_url``, ``prompt``,
``reset`` (arguments for every reset), ``reward`` (``sum`` | ``last``), ``timeout_s``,
``connect_timeout_s``, ``retries``, ``capacity_wait_s``, ``verifier_version``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from typing import Annotated, Any, Literal

import msgspec
import structlog

from streamrl.envs.base import EnvUnavailable, Prompt, ReplyResult, StepResult, user
from streamrl.envs.external import (
    CallUnconfirmed,
    ExternalSessionEnv,
    ExternalState,
    ReplayDiverged,
    confirmed_calls,
)
from streamrl.http import httpx_api
from streamrl.schema import FunctionCall, FunctionTool, Item, Message, Task, Trajectory
from streamrl.verifiers.verdict import Verdict

log = structlog.get_logger("streamrl.envs.openenv")

TOOL = "step"
_DEFAULT_PROMPT = (
    "You act in an environment by calling the `step` tool with an action; each call answers "
    "the environment's observation. Reply with a plain message when you are done."
)


class OpenEnvState(ExternalState, kw_only=True, omit_defaults=True):
    first: str = ""  # the reset observation, as the session that began the episode gave it
    rewards: list[float] = msgspec.field(default_factory=list)  # each applied step's
    done: bool = False
    server_state: dict[str, Any] = msgspec.field(default_factory=dict)  # after the last step
    session: str = ""  # which of this process's connections holds the session


class _Protocol(Exception):
    """The server answered something that is not the protocol."""


def _ws_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    for http, ws in (("https://", "wss://"), ("http://", "ws://")):
        if base.startswith(http):
            return ws + base[len(http) :] + "/ws"
    raise ValueError(f"openenv base_url must be http(s)://host:port, got {base_url!r}")


class OpenEnvEnv(ExternalSessionEnv[OpenEnvState]):
    name = "openenv"
    version = "1"
    State = OpenEnvState
    max_reward = 1.0

    class Options(msgspec.Struct, kw_only=True):
        base_url: str = "http://127.0.0.1:8000"
        prompt: str = _DEFAULT_PROMPT
        reset: dict[str, Any] = msgspec.field(default_factory=dict)
        reward: Literal["sum", "last"] = "sum"
        timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
        connect_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 5.0
        retries: Annotated[int, msgspec.Meta(ge=0)] = 3
        capacity_wait_s: Annotated[float, msgspec.Meta(ge=0)] = 30.0
        verifier_version: str = "1"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._url = _ws_url(str(self.options["base_url"]))
        self._tools: list[FunctionTool] | None = None
        self._conns: dict[str, Any] = {}  # "<task_id>/<attempt>" -> its live connection
        self.verifier_version = str(self.options["verifier_version"])

    # ---------------------------------------------------------------- tools
    def tools_for(self, task: Task) -> list[FunctionTool]:
        """``step``, whose parameters are the server's action schema (read once)."""
        if self._tools is None:
            httpx = httpx_api()
            url = str(self.options["base_url"]).rstrip("/") + "/schema"
            try:
                answer = httpx.get(url, timeout=float(self.options["timeout_s"]))
                answer.raise_for_status()
                schema = dict(answer.json()["action"])
            except Exception as e:
                raise EnvUnavailable(f"openenv: GET {url} failed: {e}") from None
            props = dict(schema.get("properties", {}))
            props.pop("metadata", None)  # every Action has it; it is not the model's to fill
            schema["properties"] = props
            schema.setdefault("type", "object")
            description = schema.pop("description", "") or "Take one action in the environment."
            schema.pop("title", None)
            self._tools = [FunctionTool(name=TOOL, description=description, parameters=schema)]
            self._tools_by_name = {t.name: t for t in self._tools}
        return self._tools

    @property
    def tools(self) -> list[FunctionTool]:  # type: ignore[override]
        return getattr(self, "_tools", None) or []

    # ---------------------------------------------------------------- tasks
    def generate(self, rng: random.Random, index: int) -> Prompt:
        """Prompt ``index``: the option's text and the observation of ``reset(seed=index)``."""
        reset = {**self.options["reset"], "seed": index}

        async def first() -> str:
            conn, answer = await self._session(reset)
            await conn.close()
            return json.dumps(answer["observation"])

        observation = asyncio.run(first())
        text = f"{self.options['prompt']}\n\nObservation: {observation}"
        return Prompt([user(text)], {"reset": {"seed": index}})

    def _reset_args(self, task: Task) -> dict[str, Any]:
        return {**self.options["reset"], **dict(task.data.get("reset") or {})}

    # ---------------------------------------------------------------- the episode
    def reset(self, task: Task) -> OpenEnvState:
        self.tools_for(task)  # a server whose schema cannot be read fails here
        return OpenEnvState()

    async def aready(self, task: Task, state: OpenEnvState, items: list[Item], save: Any):
        """As the journal's, and a session this process does not hold a connection to (a
        worker that died held it, and the server destroyed it) is replaced the same way."""
        j = state.journal
        if (
            j.phase == "open"
            and j.sending is None
            and self._conn_key(task, state) not in self._conns
        ):
            why = "the session's connection closed with the worker that held it"
            done = confirmed_calls(items)
            return await self._recover(task, state, done, save, why)
        return await super().aready(task, state, items, save)

    async def aopen(self, task: Task, state: OpenEnvState) -> OpenEnvState:
        conn, answer = await self._session(self._reset_args(task))
        first = json.dumps(answer["observation"], sort_keys=True)
        if state.first and first != state.first:
            await conn.close()
            raise ReplayDiverged(
                f"openenv: reset in a fresh session observed {first[:200]!r}, not the "
                f"recorded {state.first[:200]!r}: the server cannot reproduce this episode"
            )
        key = self._conn_key(task, state)
        self._conns[key] = conn
        return msgspec.structs.replace(
            state,
            first=first,
            rewards=[],
            done=bool(answer.get("done")),
            server_state={},
            session=key,
        )

    async def asend(self, task: Task, state: OpenEnvState, call: FunctionCall) -> StepResult:
        if call.name != TOOL:
            return StepResult(f"error: unknown tool {call.name!r} (tools: {TOOL})", state)
        try:
            action = json.loads(call.arguments) if call.arguments.strip() else {}
        except json.JSONDecodeError as e:
            return StepResult(f"error: arguments are not valid JSON: {e}", state)
        if not isinstance(action, dict):
            return StepResult("error: the action must be a JSON object", state)
        conn = self._conns.get(self._conn_key(task, state))
        if conn is None:
            raise CallUnconfirmed("openenv: this process holds no connection to the session")
        try:
            answer = await self._ask(conn, "step", action)
        except _ModelError as e:
            return StepResult(f"error: {e}", state)
        server_state = await self._ask(conn, "state", None)
        reward = answer.get("reward")
        done = bool(answer.get("done"))
        state = msgspec.structs.replace(
            state,
            rewards=[*state.rewards, float(reward) if reward is not None else 0.0],
            done=done,
            server_state=server_state,
        )
        if done:
            self._release(state)
        return StepResult(json.dumps(answer["observation"]), state, done=done)

    async def aclose_session(self, task: Task, state: OpenEnvState) -> bool:
        """Close the connection, which ends the session on the server; a session whose
        connection this process never held ended when the worker holding it died."""
        conn = self._conns.pop(self._conn_key(task, state), None)
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.send(json.dumps({"type": "close"}))
            with contextlib.suppress(Exception):
                await conn.close()
        return True

    async def aclose(self) -> None:
        conns, self._conns = list(self._conns.values()), {}
        for conn in conns:
            with contextlib.suppress(Exception):
                await conn.close()

    def reply(self, state: OpenEnvState, message: str) -> ReplyResult:
        """A plain message ends the episode, and its session with it."""
        self._release(state)
        return ReplyResult(None, True, state)

    def _release(self, state: OpenEnvState) -> None:
        """The episode is over: close its session now (a server holds few at once)."""
        conn = self._conns.pop(state.session, None)
        if conn is None:
            return
        try:
            asyncio.get_running_loop().create_task(conn.close())
        except RuntimeError:  # no loop running: the lease's aclose() closes it
            self._conns[state.session] = conn

    @staticmethod
    def _conn_key(task: Task, state: ExternalState) -> str:
        return f"{task.task_id}/{state.journal.attempt}"

    # ---------------------------------------------------------------- the wire
    async def _connect(self) -> Any:
        """A WebSocket connection; refused or timed-out connects are retried (``retries``,
        with backoff), then ``EnvUnavailable``."""
        from websockets.asyncio.client import connect

        tries = int(self.options["retries"]) + 1
        for n in range(tries):
            try:
                return await connect(
                    self._url,
                    open_timeout=float(self.options["connect_timeout_s"]),
                    max_size=None,
                    ping_interval=None,
                )
            except Exception as e:  # OSError, TimeoutError, a refused handshake
                if n == tries - 1:
                    raise EnvUnavailable(
                        f"openenv: cannot connect to {self._url} ({tries} tries): "
                        f"{type(e).__name__}: {e}"
                    ) from None
                await asyncio.sleep(min(2.0, 0.2 * 2**n))
        raise AssertionError("unreachable")

    async def _session(self, reset: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A new session and its reset observation. A server at ``max_concurrent_envs``, or a
        reset whose answer is lost (which ends that connection, and so its session), is tried
        again for ``capacity_wait_s``, then ``EnvUnavailable``."""
        loop = asyncio.get_running_loop()
        until = loop.time() + float(self.options["capacity_wait_s"])
        wait = 0.05
        while True:
            conn = await self._connect()
            try:
                return conn, await self._ask(conn, "reset", reset)
            except (_Full, CallUnconfirmed) as e:
                # a full server answers the connection with an error and closes it, which can
                # come before the reset is sent; either way no session was made
                await conn.close()
                if loop.time() >= until:
                    raise EnvUnavailable(
                        f"{e} (tried for {self.options['capacity_wait_s']} s to get a session)"
                    ) from None
            except BaseException:
                await conn.close()
                raise
            await asyncio.sleep(wait)
            wait = min(0.25, wait * 2)

    async def _ask(
        self, conn: Any, kind: str, data: Any, *, expect: str = "observation"
    ) -> dict[str, Any]:
        """One request and its answer. A lost answer is ``CallUnconfirmed``; an execution
        error or a malformed answer ``EnvUnavailable``; a validation error the model's."""
        if kind == "state":
            message: dict[str, Any] = {"type": "state"}
            expect = "state"
        else:
            message = {"type": kind, "data": data if data is not None else {}}
        try:
            async with asyncio.timeout(float(self.options["timeout_s"])):
                await conn.send(json.dumps(message))
                raw = await conn.recv()
        except Exception as e:  # a timeout, a connection closed or reset
            raise CallUnconfirmed(f"openenv {kind}: no answer ({type(e).__name__}: {e})") from None
        try:
            answer = json.loads(raw)
            kind_of, body = answer["type"], answer["data"]
            if not isinstance(body, dict):
                raise TypeError("data is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise EnvUnavailable(
                f"openenv {kind}: malformed answer {str(raw)[:200]!r}: {e}"
            ) from None
        if kind_of == "error":
            code = str(body.get("code", ""))
            if kind == "step" and code.endswith("VALIDATION_ERROR"):
                raise _ModelError(f"invalid action: {json.dumps(body.get('errors', body))[:500]}")
            why = f"openenv {kind}: the server answered {code}: {body.get('message')}"
            raise (_Full if code.endswith("CAPACITY_REACHED") else EnvUnavailable)(why)
        if kind_of != expect or (expect == "observation" and "observation" not in body):
            raise EnvUnavailable(f"openenv {kind}: expected {expect}, got {str(raw)[:200]!r}")
        return body

    # ---------------------------------------------------------------- verification
    def verify(self, task: Task, trajectory: Trajectory, state: OpenEnvState) -> Verdict:
        """A pure function of the rewards the episode recorded."""
        rewards = state.rewards
        reward = (
            (rewards[-1] if rewards else 0.0) if self.options["reward"] == "last" else sum(rewards)
        )
        j = state.journal
        return Verdict(
            reward=float(reward),
            components={"steps": float(len(rewards))},
            info={
                "rewards": rewards,
                "done": state.done,
                "server_state": state.server_state,
                "sessions": j.attempt + 1,
            },
        )

    @property
    def verifier_id(self) -> tuple[str, str]:
        return ("openenv", self.verifier_version)

    # ---------------------------------------------------------------- a reference agent
    def reference(self, task: Task, items: list[Item], state: OpenEnvState) -> Item:
        """The row's ``reference_actions``, one per turn, then a closing message."""
        actions = list(task.data.get("reference_actions") or [])
        n = sum(1 for i in items[len(task.input) :] if isinstance(i, FunctionCall))
        if n < len(actions):
            return FunctionCall(call_id=f"ref{n}", name=TOOL, arguments=json.dumps(actions[n]))
        return Message(role="assistant", content="done")


class _Full(EnvUnavailable):
    """The server holds its ``max_concurrent_envs`` sessions already."""


class _ModelError(Exception):
    """A step the server refused as invalid: the model's mistake, shown to it."""
