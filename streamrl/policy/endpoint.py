"""The rollout worker's policy served over HTTP: an OpenAI-compatible endpoint inside the worker
process, for environments whose own agent drives the episode and calls "the model" over HTTP
(NeMo Gym 0.7's environment servers, PrimeIntellect ``verifiers``' harnesses).

Each request is answered by the worker's policy backend (``hf``, ``openai``, ``scripted``) and
recorded, with its prompt token ids, completion token ids, behaviour log-probs and policy
version (a ``ModelTurn``), on the **episode it belongs to**, so the learner trains on an episode
driven from outside exactly as on one the worker drove. An episode is opened here under a key
(``open``) before its driver is started and closed (``close``) when the driver has answered; a
request for a key that is not open (a driver still running an attempt whose worker died, a
typo) is refused with 404 and recorded nowhere. How a request names its episode:

- ``POST /ng-rollout/<key>/v1/responses`` (and ``.../training-token-capture/v1/responses``):
  NeMo Gym's rollout path. Its agents call the model server under the episode's
  ``EpisodeId.capture_key``, so an environment server's agent reaches the endpoint with no
  change when its model server is the endpoint's address;
- ``POST /episodes/<key>/v1/responses``: the same for any other client (a per-episode
  ``base_url``);
- ``POST /v1/responses`` with ``Authorization: Bearer <key>``: a per-episode API key;
- the same three forms for ``/v1/chat/completions``.

Responses API requests take ``input`` (a string or items), ``tools`` (function tools) and
``max_output_tokens``; chat completions take ``messages`` (with ``tool_calls`` and ``tool``
messages), ``tools`` and ``max_tokens`` / ``max_completion_tokens``. Sampling settings in the
request (temperature...) are not applied: the episode is sampled as the run's policy config says,
so that the behaviour log-probs are the policy's. The answer is a ``Response`` (status
``incomplete`` when the turn hit its token limit) or a ``chat.completion``, with ``usage``.

Started in the worker's event loop (uvicorn, no signal handlers of its own: rq's stay), on the
configured ``host:port`` (port 0: a free one); ``url`` is its address once started.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from typing import Any

import structlog

from streamrl.envs._failpoints import failpoint
from streamrl.policy.base import Policy, PolicyRequest
from streamrl.responses import items_from_json, response_json, tools_from_json
from streamrl.schema import FunctionCall, FunctionCallOutput, Item, Message, ModelTurn, Task

__all__ = ["Capture", "Endpoints", "PolicyEndpoint", "chat_items"]

log = structlog.get_logger("streamrl.policy.endpoint")

ROLLOUT_PREFIX = "ng-rollout"  # NeMo Gym's ROLLOUT_PATH_PREFIX
TOKEN_CAPTURE = "training-token-capture"  # NeMo Gym's TOKEN_CAPTURE_PATH_SEGMENT


class Capture:
    """One open episode: what its driver asked and what the policy answered."""

    def __init__(self, key: str, task: Task, state: Any = None) -> None:
        self.key = key
        self.task = task
        self.state = state
        self.turns: list[ModelTurn] = []
        self.items: list[Item] = []  # the longest conversation seen: a request and its answer
        self.refused = 0

    def record(self, items: list[Item], turn: ModelTurn) -> None:
        turn.index = len(self.turns)
        self.turns.append(turn)
        if len(items) + len(turn.items) >= len(self.items):
            self.items = [*items, *turn.items]


def chat_items(messages: Any) -> list[Item]:
    """Chat completions ``messages`` as streamrl items (assistant ``tool_calls`` as function
    calls, ``tool`` messages as their outputs)."""
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    out: list[Item] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is not an object")
        role = m.get("role")
        content = m.get("content") or ""
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if role == "tool":
            out.append(FunctionCallOutput(call_id=str(m.get("tool_call_id", "")), output=content))
            continue
        if role not in ("system", "developer", "user", "assistant"):
            raise ValueError(f"message {i}: unsupported role {role!r}")
        if content or role != "assistant" or not m.get("tool_calls"):
            out.append(Message(role=role, content=content))
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            args = fn.get("arguments", "")
            out.append(
                FunctionCall(
                    call_id=str(call.get("id", "")),
                    name=str(fn.get("name", "")),
                    arguments=args if isinstance(args, str) else json.dumps(args),
                )
            )
    return out


def _chat_tools(raw: Any) -> Any:
    """Chat ``tools`` (``{type: function, function: {...}}``) in the Responses form."""
    if not isinstance(raw, list):
        return raw
    return [
        {"type": "function", **t["function"]} if isinstance(t, dict) and "function" in t else t
        for t in raw
    ]


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class PolicyEndpoint:
    """The endpoint of one rollout worker (see the module)."""

    def __init__(
        self, policy: Policy, host: str = "127.0.0.1", port: int = 0, model: str = "streamrl"
    ) -> None:
        self.policy = policy
        self.host, self.port = host, port
        self.model = model
        self.episodes: dict[str, Capture] = {}
        self.counts = {"requests": 0, "refused": 0}
        self._server: Any = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # ---------------------------------------------------------------- episodes
    def open(self, key: str, task: Task, state: Any = None) -> Capture:
        if key in self.episodes:
            raise ValueError(f"episode {key!r} is already open on this endpoint")
        capture = self.episodes[key] = Capture(key, task, state)
        return capture

    def close(self, key: str) -> Capture | None:
        return self.episodes.pop(key, None)

    # ---------------------------------------------------------------- serving
    async def start(self) -> str:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Route

        routes = []
        for path, kind in (("/v1/responses", "responses"), ("/v1/chat/completions", "chat")):
            handler = self._handler(kind)
            routes += [
                Route(path, handler, methods=["POST"]),
                Route(f"/episodes/{{key}}{path}", handler, methods=["POST"]),
                Route(f"/{ROLLOUT_PREFIX}/{{key}}{path}", handler, methods=["POST"]),
                Route(
                    f"/{ROLLOUT_PREFIX}/{{key}}/{TOKEN_CAPTURE}{path}", handler, methods=["POST"]
                ),
            ]
        routes.append(Route("/v1/models", self._models, methods=["GET"]))
        app = Starlette(routes=routes)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"the policy endpoint cannot listen on {self.url}: {e}") from e
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its error
                raise OSError(f"the policy endpoint on {self.url} stopped at start")
            await asyncio.sleep(0.01)
        log.info("policy endpoint serving", url=self.url)
        return self.url

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self._task, timeout=5)
        self._server = self._task = None

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def _handler(self, kind: str) -> Any:
        async def handle(request: Any) -> Any:
            from starlette.responses import JSONResponse

            self.counts["requests"] += 1
            try:
                capture = self._capture(request)
                try:
                    body = json.loads(await request.body())
                except json.JSONDecodeError as e:
                    raise _Refused(400, f"the body is not JSON: {e}") from None
                if not isinstance(body, dict):
                    raise _Refused(400, "the body is not a JSON object")
                answer = await (self._responses if kind == "responses" else self._chat)(
                    capture, body
                )
            except _Refused as e:
                self.counts["refused"] += 1
                log.warning("policy endpoint refused a request", status=e.status, error=str(e))
                kind_ = "not_found" if e.status == 404 else "invalid_request_error"
                if e.status == 503:
                    kind_ = "server_error"
                return JSONResponse(
                    {"error": {"message": str(e), "type": kind_}}, status_code=e.status
                )
            if kind == "chat" and body.get("stream") is True:
                return _chat_stream(answer)
            return JSONResponse(answer)

        return handle

    def _capture(self, request: Any) -> Capture:
        key = request.path_params.get("key")
        if key is None:
            auth = request.headers.get("authorization", "")
            key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
        capture = self.episodes.get(key)
        if capture is None:
            raise _Refused(
                404,
                f"no open episode {key!r} on this endpoint (it ended, or the worker that ran "
                "it died and its attempt was given up)",
            )
        return capture

    async def _turn(
        self, capture: Capture, items: list[Item], tools_raw: Any, max_tokens: Any
    ) -> ModelTurn:
        try:
            tools = tools_from_json(tools_raw)
        except ValueError as e:
            raise _Refused(400, str(e)) from None
        request = PolicyRequest(
            task=capture.task,
            items=items,
            tools=tools,
            state=capture.state,
            turn=len(capture.turns),
            max_new_tokens=max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else 0,
            previous=capture.turns[-1] if capture.turns else None,
        )
        try:
            turn = await self.policy.respond(request)
        except Exception as e:  # the backend's failure is not the model's answer
            raise _Refused(503, f"the policy failed: {type(e).__name__}: {e}") from e
        if self.episodes.get(capture.key) is not capture:  # closed while generating
            raise _Refused(404, f"episode {capture.key!r} ended while its turn was generated")
        capture.record(items, turn)
        failpoint("after_policy_turn", f"{capture.key}/{turn.index}")
        return turn

    async def _responses(self, capture: Capture, body: dict[str, Any]) -> dict[str, Any]:
        try:
            items = items_from_json(body.get("input", []), "input")
        except ValueError as e:
            raise _Refused(400, str(e)) from None
        turn = await self._turn(capture, items, body.get("tools"), body.get("max_output_tokens"))
        n = turn.index
        out = response_json(
            f"resp_{capture.key}_{n}", turn.items, time.time(), self.model, body.get("tools"),
            prefix=f"{n}_", parallel_tool_calls=body.get("parallel_tool_calls", True) is not False,
        )  # fmt: skip
        if turn.finish_reason == "length":
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        out["usage"] = {
            **_usage(turn, "input_tokens", "output_tokens"),
            "input_tokens_details": {"cached_tokens": 0},  # what OpenAI's ResponseUsage requires
            "output_tokens_details": {"reasoning_tokens": 0},
        }
        return out

    async def _chat(self, capture: Capture, body: dict[str, Any]) -> dict[str, Any]:
        try:
            items = chat_items(body.get("messages"))
        except (ValueError, AttributeError) as e:
            raise _Refused(400, f"messages: {e}") from None
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        turn = await self._turn(capture, items, _chat_tools(body.get("tools")), limit)
        text = "".join(i.content for i in turn.items if isinstance(i, Message))
        calls = [
            {"id": i.call_id, "type": "function",
             "function": {"name": i.name, "arguments": i.arguments}}
            for i in turn.items if isinstance(i, FunctionCall)
        ]  # fmt: skip
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls else turn.finish_reason
        return {
            "id": f"chatcmpl_{capture.key}_{turn.index}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": _usage(turn, "prompt_tokens", "completion_tokens"),
        }


class Endpoints:
    """A rollout lease's endpoints, one per address, each started when an environment that
    drives its own episodes (``serves_episodes``: nemo-gym mode=run) first needs it."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.started: dict[tuple[str, int], PolicyEndpoint] = {}
        self._lock = asyncio.Lock()

    async def for_env(self, env: Any) -> PolicyEndpoint | None:
        """The endpoint at ``env.endpoint_address``; None for an environment the worker drives
        itself. OSError when it cannot listen there."""
        if not getattr(env, "serves_episodes", False):
            return None
        address = env.endpoint_address
        async with self._lock:
            endpoint = self.started.get(address)
            if endpoint is None:
                model = str(getattr(env, "options", {}).get("model", "streamrl"))
                endpoint = PolicyEndpoint(self.policy, *address, model=model)
                await endpoint.start()
                self.started[address] = endpoint
        return endpoint

    async def stop(self) -> None:
        for endpoint in self.started.values():
            await endpoint.stop()
        self.started.clear()


def _chat_stream(answer: dict[str, Any]) -> Any:
    """A chat completion asked for with ``stream: true`` (the chat program of PrimeIntellect
    ``verifiers``' harnesses, through its interception server): the whole turn as one
    ``chat.completion.chunk`` (its message as the delta, tool calls indexed, the finish reason
    and usage) and ``[DONE]``, as server-sent events. The turn is generated whole first: there
    is nothing to gain from token-by-token events for a driver that assembles the turn."""
    from starlette.responses import Response

    choice = answer["choices"][0]
    delta = dict(choice["message"])
    if delta.get("tool_calls"):
        delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
    chunk = {
        **{k: v for k, v in answer.items() if k != "choices"},
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": choice["finish_reason"]}],
    }
    body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
    return Response(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _usage(turn: ModelTurn, prompt: str, completion: str) -> dict[str, int]:
    p, c = len(turn.prompt_token_ids), len(turn.token_ids)
    return {prompt: p, completion: c, "total_tokens": p + c}


class _QuietServer:
    """uvicorn's server without its signal handlers (the rq work horse keeps its own)."""

    def __new__(cls, config: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # type: ignore[override]
                yield

        return Server(config)
