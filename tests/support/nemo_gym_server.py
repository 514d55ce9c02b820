"""A resources server written the way NeMo Gym writes them, for the nemo-gym tests.

FastAPI, Starlette's ``SessionMiddleware`` with a middleware that gives every new session a
``session_id`` (as NeMo Gym's ``SimpleServer.setup_session_middleware`` does), typed pydantic
request and response models shaped like ``BaseVerifyRequest``/``BaseVerifyResponse``, per-session
state in the server's memory, keyed by the cookie's session id (as its
``example_session_state_mgmt`` server keeps ``session_id_to_counter``).

Tools: ``increment_counter`` / ``get_counter_value`` (stateful), ``kv_set`` / ``kv_get`` (a
small key-value store; ``kv_get`` of a missing key is a 404), ``draw_ticket`` (a random ticket
each call: an answer no replay reproduces). ``/verify`` rewards 1.0 when the session's counter
equals the row's ``expected_count``. ``/close_session`` is NeMo Gym 0.7's
(``{resources_session_id, episode_id}``, idempotent, the session named by its cookie); a closed
session refuses calls and ``/verify`` with a 409, and a call that was in progress when its session
was closed is not applied.

Faults, chosen per row by its ``fault`` field (the row reaches ``/seed_session``):
``tool_5xx`` (every counter call answers 503), ``tool_slow`` (counter calls sleep
``slow_s``), ``tool_flaky`` (the first counter call of a session answers 503, then it works),
``verify_5xx``, ``verify_malformed`` (200 with a body that is not JSON), ``verify_no_reward``,
``verify_masked`` (``mask_sample: true``), ``seed_5xx``, ``tool_lost_answer`` (the first counter
call of the row's label, over all its sessions, is applied and then answered only after
``slow_s``: the client times out and never learns that it was applied).

Seeds: ``--protocol`` (see ``CounterResourcesServer``): NeMo Gym 0.7's typed seed, the legacy
one, with or without ``/close_session``.

``GET /_sessions`` shows the server-side state, for the tests' checks: per session its seeds,
the calls applied (``calls``, in order, each with its global sequence number in ``seqs``),
``verifies`` and ``closed``.
Run: ``python -m tests.support.nemo_gym_server --port 8000``.
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.middleware.sessions import SessionMiddleware

SESSION_ID_KEY = "session_id"


# ---------------------------------------------------------------- the Responses types it checks


class ResponsesCreateParams(BaseModel):
    model_config = ConfigDict(extra="allow")
    input: str | list[dict[str, Any]]
    tools: list[dict[str, Any]] = []


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: Literal["completed", "incomplete", "in_progress"]
    content: list[OutputText]


class FunctionToolCall(BaseModel):
    type: Literal["function_call"]
    id: str | None = None
    call_id: str
    name: str
    arguments: str
    status: str | None = None


class FunctionCallOutput(BaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class SummaryText(BaseModel):
    type: Literal["summary_text"]
    text: str


class ReasoningItem(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[SummaryText]


OutputItem = Annotated[
    OutputMessage | FunctionToolCall | FunctionCallOutput | ReasoningItem,
    Field(discriminator="type"),
]


class Response(BaseModel):
    id: str
    object: Literal["response"]
    created_at: float
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    tool_choice: str
    tools: list[dict[str, Any]]


class BaseRunRequest(BaseModel):
    responses_create_params: ResponsesCreateParams


class BaseVerifyRequest(BaseRunRequest):
    response: Response


class BaseVerifyResponse(BaseVerifyRequest):
    reward: float


class BaseSeedSessionRequest(BaseModel):
    pass


class BaseSeedSessionResponse(BaseModel):
    pass


# ---------------------------------------------------------------- this server's models


class CounterSeedSessionRequest(BaseSeedSessionRequest):
    initial_count: int = 0
    label: str = ""
    fault: str = ""
    slow_s: float = 5.0


class CounterSeedSessionResponse(BaseSeedSessionResponse):
    session_id: str


class IncrementCounterRequest(BaseModel):
    count: int


class IncrementCounterResponse(BaseModel):
    success: bool


class GetCounterValueResponse(BaseModel):
    count: int


class KVSetRequest(BaseModel):
    key: str
    value: str


class KVGetRequest(BaseModel):
    key: str


class KVGetResponse(BaseModel):
    value: str


class DrawTicketResponse(BaseModel):
    ticket: str


class EpisodeId(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rollout_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    attempt: int = Field(default=0, ge=0)


class ResourcesCloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resources_session_id: str
    episode_id: EpisodeId


class ResourcesCloseSessionResponse(BaseModel):
    resources_session_id: str


class CounterVerifyRequest(BaseVerifyRequest):
    expected_count: int


class CounterVerifyResponse(BaseVerifyResponse):
    expected_count: int
    counter: int
    tool_calls: int
    failure_kind: str | None = None


class SessionRecord(BaseModel):
    label: str = ""
    fault: str = ""
    slow_s: float = 5.0
    count: int = 0
    seeds: int = 0
    calls: list[str] = []
    kv: dict[str, str] = {}
    seqs: list[int] = []
    verifies: int = 0
    counter_failures: int = 0
    closed: bool = False
    close_body: dict[str, Any] = {}
    episode_id: dict[str, Any] | None = None  # a typed seed's


class TaskId(BaseModel):
    model_config = ConfigDict(extra="forbid")
    taskset: str = Field(min_length=1)
    task_id: str = Field(min_length=1)


class ResourcesSeedSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    resources_session_id: str = Field(min_length=1)
    episode_id: EpisodeId
    task_id: TaskId
    task_data: dict[str, Any]


class RunTaskInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    responses_create_params: dict[str, Any]
    task_data: dict[str, Any]


class MaterializedTask(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_id: TaskId
    task_input: RunTaskInput


class RunRequest(BaseModel):
    """NeMo Gym 0.7's episode request (``BaseEpisodeRequest``), as ``single_agent_turn`` reads
    it."""

    model_config = ConfigDict(extra="forbid")
    episode_id: EpisodeId
    task: MaterializedTask


PROTOCOLS = ("mixed", "typed", "legacy")


class CounterResourcesServer:
    """``protocol``: ``mixed`` (the legacy seed, and 0.7's ``/close_session``), ``typed``
    (0.7's typed seed besides the legacy one: the session keyed by ``resources_session_id``,
    echoed; a closed id refuses a late seed) or ``legacy`` (0.4: no ``/close_session``)."""

    def __init__(
        self, secret: str = "streamrl-test-secret", protocol: str = "mixed", model_url: str = ""
    ) -> None:
        self.protocol = protocol
        self.model_url = model_url.rstrip("/")
        self.failed_once: set[str] = set()  # labels whose first /run failed (run_flaky)
        self.secret = secret
        self.sessions: dict[str, SessionRecord] = {}
        self.seq = 0
        self.lost_answers: set[str] = set()  # labels whose one answer was lost

    def session(self, request: Request) -> SessionRecord:
        sid = request.session[SESSION_ID_KEY]
        record = self.sessions.get(sid)
        if record is None:  # a cookie this server never seeded
            raise HTTPException(409, f"session {sid} was never seeded")
        if record.closed:
            raise HTTPException(409, f"session {sid} is closed")
        return record

    def apply(self, record: SessionRecord, call: str) -> None:
        """Log a call as applied (the server's own record of what it did, for the checks)."""
        if record.closed:  # closed while the call was in progress: not applied
            raise HTTPException(409, "session closed")
        self.seq += 1
        record.calls.append(call)
        record.seqs.append(self.seq)

    def setup_webserver(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def add_session_id(request: Request, call_next):
            if SESSION_ID_KEY not in request.session:
                request.session[SESSION_ID_KEY] = str(uuid.uuid4())
            return await call_next(request)

        # added last, so it runs first: the session exists when add_session_id runs
        app.add_middleware(SessionMiddleware, secret_key=self.secret, session_cookie="session")

        app.post("/seed_session")(
            self.seed_session if self.protocol == "typed" else self.seed_legacy
        )
        app.post("/increment_counter")(self.increment_counter)
        app.post("/get_counter_value")(self.get_counter_value)
        app.post("/kv_set")(self.kv_set)
        app.post("/kv_get")(self.kv_get)
        app.post("/draw_ticket")(self.draw_ticket)
        app.post("/verify")(self.verify)
        if self.protocol != "legacy":
            app.post("/close_session")(self.close_session)
        app.get("/_sessions")(self.list_sessions)
        if self.model_url:
            app.post("/run")(self.run)
        return app

    # ---------------------------------------------------------------- an environment server
    async def run(self, body: RunRequest) -> dict[str, Any]:
        """``POST /run`` as a NeMo Gym 0.7 environment server (``single_agent_turn``'s shape)
        with its resources in this process: seed a session (keyed by a fresh id, holding the
        ``episode_id``), run an agent that calls the model at ``model_url`` under the episode's
        capture key (NeMo Gym's ``/ng-rollout/<key>/v1/responses``) and applies each tool call
        to the session, verify it, and close it whatever happened (the cleanup a
        ``CleanupContext`` runs). A model call that fails (the worker serving the episode
        died, or gave the attempt up) is a non-terminal failure at stage ``agent``. Faults (the
        row's ``fault``): ``run_terminal`` (a terminal failure), ``run_flaky`` (the first /run
        of the label fails, not terminal), ``verify_masked``."""
        import httpx

        ep = body.episode_id
        key = ep.rollout_id if ep.attempt == 0 else f"{ep.rollout_id}-a{ep.attempt}"
        data = body.task.task_input.task_data
        params = body.task.task_input.responses_create_params
        seed = CounterSeedSessionRequest.model_validate(data)

        def failure(stage: str, reason: str, terminal: bool) -> dict[str, Any]:
            return {
                "episode_id": ep.model_dump(),
                "task_id": body.task.task_id.model_dump(),
                "failure": {"failure_reason": reason[:2000], "terminal": terminal, "stage": stage},
            }

        if seed.fault == "run_terminal":
            return failure("agent", "this task cannot run", True)
        if seed.fault == "run_flaky" and seed.label not in self.failed_once:
            self.failed_once.add(seed.label)
            return failure("agent", "a passing hiccup", False)
        sid = f"resources-session-{uuid.uuid4().hex}"
        record = self.sessions[sid] = SessionRecord(
            label=seed.label, fault=seed.fault, count=seed.initial_count, seeds=1,
            episode_id=ep.model_dump(),
        )  # fmt: skip
        outputs: list[dict[str, Any]] = []
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                for _ in range(8):
                    request = {**params, "input": [*params["input"], *outputs]}
                    url = f"{self.model_url}/ng-rollout/{key}/v1/responses"
                    try:
                        resp = await client.post(url, json=request)
                    except httpx.HTTPError as e:
                        return failure("agent", f"model call failed: {e!r}", False)
                    if resp.status_code != 200:
                        reason = f"model call: HTTP {resp.status_code}: {resp.text[:300]}"
                        return failure("agent", reason, False)
                    output = resp.json()["output"]
                    outputs += output
                    calls = [o for o in output if o["type"] == "function_call"]
                    if not calls:
                        break
                    for call in calls:
                        outputs.append(
                            {"type": "function_call_output", "call_id": call["call_id"],
                             "output": self._apply_call(record, call)}
                        )  # fmt: skip
            record.verifies += 1
            expected = int(data.get("expected_count", 0))
            response = {
                "id": f"resp_{key}", "object": "response", "created_at": 0.0, "model": "policy",
                "output": outputs, "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": params.get("tools", []),
            }  # fmt: skip
            result = {
                **data, "responses_create_params": params, "response": response,
                "reward": float(record.count == expected), "counter": record.count,
                "tool_calls": len(record.calls),
            }  # fmt: skip
            if seed.fault == "verify_masked":
                result |= {"mask_sample": True, "failure_kind": "judge_unavailable",
                           "failure_reason": "the judge timed out"}  # fmt: skip
            return {"episode_id": ep.model_dump(), "task_id": body.task.task_id.model_dump(),
                    "result": result}  # fmt: skip
        finally:
            record.closed = True

    def _apply_call(self, record: SessionRecord, call: dict[str, Any]) -> str:
        import json

        try:
            args = json.loads(call["arguments"] or "{}")
        except json.JSONDecodeError as e:
            return json.dumps({"error": f"Invalid tool call arguments: {e!r}"})
        if call["name"] == "increment_counter":
            self.apply(record, f"increment_counter:{args['count']}")
            record.count += int(args["count"])
            return json.dumps({"success": True})
        if call["name"] == "get_counter_value":
            self.apply(record, "get_counter_value")
            return json.dumps({"count": record.count})
        return json.dumps({"error": f"unknown tool {call['name']}"})

    async def seed_legacy(self, request: Request, raw: CounterSeedSessionRequest) -> Any:
        """The row (a typed body is read as one, its fields ignored, as 0.4's models do)."""
        return (await self._seed(request, raw)).model_dump()

    async def seed_session(
        self, request: Request, raw: ResourcesSeedSessionRequest | CounterSeedSessionRequest
    ) -> dict[str, Any]:
        """The typed seed or the legacy row (the union is what 0.7's servers declare, so their
        OpenAPI schema names the typed one)."""
        if isinstance(raw, ResourcesSeedSessionRequest):
            typed = raw
            sid = typed.resources_session_id
            known = self.sessions.get(sid)
            if known is not None and known.closed:
                raise HTTPException(409, f"session {sid} is closed")
            if known is not None and known.episode_id != typed.episode_id.model_dump():
                raise HTTPException(409, f"session {sid} is bound to another episode")
            request.session[SESSION_ID_KEY] = sid
            body = CounterSeedSessionRequest.model_validate(typed.task_data)
            await self._seed(request, body)
            self.sessions[sid].episode_id = typed.episode_id.model_dump()
            return {"resources_session_id": sid}
        return (await self._seed(request, raw)).model_dump()

    async def _seed(
        self, request: Request, body: CounterSeedSessionRequest
    ) -> CounterSeedSessionResponse:
        if body.fault == "seed_5xx":
            raise HTTPException(503, "seeding is down")
        sid = request.session[SESSION_ID_KEY]
        record = self.sessions.setdefault(
            sid,
            SessionRecord(
                label=body.label, fault=body.fault, slow_s=body.slow_s, count=body.initial_count
            ),
        )
        record.seeds += 1
        return CounterSeedSessionResponse(session_id=sid)

    async def _counter_fault(self, record: SessionRecord) -> None:
        if record.fault == "tool_5xx":
            raise HTTPException(503, "the counter service is overloaded")
        if record.fault == "tool_flaky" and record.counter_failures == 0:
            record.counter_failures += 1
            raise HTTPException(503, "a passing hiccup")
        if record.fault == "tool_slow":
            await asyncio.sleep(record.slow_s)

    async def increment_counter(
        self, request: Request, body: IncrementCounterRequest
    ) -> IncrementCounterResponse:
        record = self.session(request)
        await self._counter_fault(record)
        self.apply(record, f"increment_counter:{body.count}")
        record.count += body.count
        if record.fault == "tool_lost_answer" and record.label not in self.lost_answers:
            self.lost_answers.add(record.label)
            await asyncio.sleep(record.slow_s)
        return IncrementCounterResponse(success=True)

    async def get_counter_value(self, request: Request) -> GetCounterValueResponse:
        record = self.session(request)
        await self._counter_fault(record)
        self.apply(record, "get_counter_value")
        return GetCounterValueResponse(count=record.count)

    async def kv_set(self, request: Request, body: KVSetRequest) -> IncrementCounterResponse:
        record = self.session(request)
        self.apply(record, f"kv_set:{body.key}")
        record.kv[body.key] = body.value
        return IncrementCounterResponse(success=True)

    async def kv_get(self, request: Request, body: KVGetRequest) -> KVGetResponse:
        record = self.session(request)
        self.apply(record, f"kv_get:{body.key}")
        if body.key not in record.kv:
            raise HTTPException(404, f"no key {body.key!r}")
        return KVGetResponse(value=record.kv[body.key])

    async def draw_ticket(self, request: Request) -> DrawTicketResponse:
        record = self.session(request)
        self.apply(record, "draw_ticket")
        return DrawTicketResponse(ticket=uuid.uuid4().hex)

    async def close_session(
        self, request: Request, body: ResourcesCloseSessionRequest
    ) -> ResourcesCloseSessionResponse:
        record = self.sessions.get(body.resources_session_id)
        if record is None or record.episode_id is None:  # a legacy seed's: by its cookie
            record = self.sessions.get(request.session[SESSION_ID_KEY])
        if record is None and self.protocol == "typed":  # never seeded: a late seed is refused
            record = self.sessions[body.resources_session_id] = SessionRecord(
                episode_id=body.episode_id.model_dump()
            )
        if record is not None:  # closing an unknown or closed session succeeds too
            record.closed = True
            record.close_body = body.model_dump()
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)

    async def verify(self, request: Request, body: CounterVerifyRequest) -> Any:
        record = self.session(request)
        record.verifies += 1
        if record.fault == "verify_5xx":
            return JSONResponse({"detail": "the judge is down"}, status_code=502)
        if record.fault == "verify_malformed":
            return PlainTextResponse("<html>proxy error</html>", status_code=200)
        if record.fault == "verify_no_reward":
            return JSONResponse({"ok": True})
        reward = float(record.count == body.expected_count)
        answer = CounterVerifyResponse(
            **body.model_dump(),
            reward=reward,
            counter=record.count,
            tool_calls=len(record.calls),
        )
        if record.fault == "verify_masked":
            return JSONResponse(
                {
                    **answer.model_dump(),
                    "mask_sample": True,
                    "failure_kind": "judge_unavailable",
                    "failure_reason": "the judge timed out",
                }
            )
        return answer

    async def list_sessions(self) -> dict[str, SessionRecord]:
        return self.sessions


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--protocol", choices=PROTOCOLS, default="mixed")
    ap.add_argument("--model-url", default="", help="serve /run, calling the model here")
    args = ap.parse_args()
    app = CounterResourcesServer(protocol=args.protocol, model_url=args.model_url)
    app = app.setup_webserver()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
