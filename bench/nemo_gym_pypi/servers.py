"""Resources servers built on the PyPI ``nemo-gym`` package (``SimpleResourcesServer``), for
``bench/nemo_gym_pypi.py``. Run under a Python >= 3.12 that has ``nemo-gym`` installed:

    python servers.py --kind counter|copy --port 8000

``copy``: the streamrl ``copy`` task as a resources server (``/verify`` scores the final
assistant text of ``response.output`` against the row's ``answer``, position by position), so
the tiny model can be trained through it.

``counter``: the stateful counter of NeMo Gym's ``example_session_state_mgmt``:
``/increment_counter``, ``/get_counter_value``, state per session id (the signed session
cookie), and ``/verify`` rewards 1.0 when the counter equals the row's ``expected_count``.

Both ``/verify`` endpoints take NeMo Gym's own ``BaseVerifyRequest``
(``NeMoGymResponseCreateParamsNonStreaming`` and ``NeMoGymResponse``), so what streamrl sends
is validated by NeMo Gym's pydantic models. ``GET /_sessions`` shows the counter's state.

Under nemo-gym 0.7 the counter also takes 0.7's typed seed (``ResourcesSeedSessionRequest``,
the session keyed by its ``resources_session_id``, echoed back) and ``/close_session`` (a closed
id refuses calls, ``/verify`` and a late seed, as 0.7's contract asks), and records per session
its seeds, calls, verifies, close and the ``episode_id`` it was seeded with; the legacy seed
(the row) still works, keyed by the cookie, as 0.4 has it.

``judge`` (0.7 only): ``/verify`` asks a judge (``judge_url`` in the row; a closed port when
the row says ``judge_down``) through NeMo Gym's own ``reraise_judge_errors``, so the server's
own ``judge_failsafe`` turns a judge that cannot be reached into ``reward 0.0`` with
``mask_sample: true`` and ``failure_kind: judge_failed``; a judge that answers gives a
``BaseMultiRewardVerifyResponse`` with ``reward_components``.

``shipped:<module>:<Class>``: a resources server that the wheel itself ships (e.g.
``resources_servers.example_single_tool_call.app:SimpleWeatherResourcesServer``), run as is.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
from typing import Any

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from nemo_gym.base_resources_server import (
    BaseResourcesServerConfig,
    BaseSeedSessionRequest,
    BaseSeedSessionResponse,
    BaseVerifyRequest,
    BaseVerifyResponse,
    SimpleResourcesServer,
)
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.server_utils import SESSION_ID_KEY, ServerClient
from omegaconf import OmegaConf
from pydantic import BaseModel, Field

try:  # nemo-gym >= 0.7
    from nemo_gym.base_resources_server import (
        BaseMultiRewardVerifyResponse,
        ResourcesCloseSessionRequest,
        ResourcesCloseSessionResponse,
        ResourcesSeedSessionRequest,
        ResourcesSeedSessionResponse,
    )
    from nemo_gym.judge import reraise_judge_errors

    TYPED = True
except ImportError:  # 0.4: the legacy seed only
    TYPED = False


class IncrementCounterRequest(BaseModel):
    count: int


class IncrementCounterResponse(BaseModel):
    success: bool


class GetCounterValueResponse(BaseModel):
    count: int


class CounterVerifyRequest(BaseVerifyRequest):
    expected_count: int


class CounterVerifyResponse(BaseVerifyResponse):
    expected_count: int
    counter: int
    calls: int


class CounterSeedSessionRequest(BaseSeedSessionRequest):
    initial_count: int = 0


class CounterResourcesServer(SimpleResourcesServer):
    session_id_to_counter: dict[str, int] = Field(default_factory=dict)
    session_id_to_calls: dict[str, list[int]] = Field(default_factory=dict)
    session_id_to_seeds: dict[str, int] = Field(default_factory=dict)
    session_id_to_verifies: dict[str, int] = Field(default_factory=dict)
    session_id_to_episode: dict[str, dict] = Field(default_factory=dict)
    closed: set[str] = Field(default_factory=set)

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/increment_counter")(self.increment_counter)
        app.post("/get_counter_value")(self.get_counter_value)
        app.get("/_sessions")(self.sessions)
        return app

    def _sid(self, request: Request) -> str:
        sid = request.session[SESSION_ID_KEY]
        if sid in self.closed:
            raise HTTPException(409, f"session {sid} is closed")
        return sid

    async def seed_session(self, request: Request, body: dict) -> dict:
        """0.7's typed seed (keyed by ``resources_session_id``, echoed) or the legacy row."""
        if TYPED and "episode_id" in body:
            typed = ResourcesSeedSessionRequest.model_validate(body)
            sid = typed.resources_session_id
            if sid in self.closed:
                raise HTTPException(409, f"session {sid} is closed")
            request.session[SESSION_ID_KEY] = sid
            initial = CounterSeedSessionRequest.model_validate(typed.task_data).initial_count
            self.session_id_to_episode[sid] = typed.episode_id.model_dump()
            answer = ResourcesSeedSessionResponse(resources_session_id=sid).model_dump()
        else:
            initial = CounterSeedSessionRequest.model_validate(body).initial_count
            sid = request.session[SESSION_ID_KEY]
            answer = BaseSeedSessionResponse().model_dump()
        self.session_id_to_counter.setdefault(sid, initial)
        self.session_id_to_seeds[sid] = self.session_id_to_seeds.get(sid, 0) + 1
        return answer

    async def close_resources_session(
        self, request: Request, body: ResourcesCloseSessionRequest
    ) -> ResourcesCloseSessionResponse:
        """The id a typed seed named, else the cookie's session (a legacy seed's)."""
        sid = body.resources_session_id
        if sid not in self.session_id_to_counter:
            sid = request.session.get(SESSION_ID_KEY, sid)
        self.closed.add(body.resources_session_id)
        self.closed.add(sid)
        return ResourcesCloseSessionResponse(resources_session_id=body.resources_session_id)

    async def increment_counter(
        self, request: Request, body: IncrementCounterRequest
    ) -> IncrementCounterResponse:
        sid = self._sid(request)
        self.session_id_to_counter[sid] = self.session_id_to_counter.get(sid, 0) + body.count
        self.session_id_to_calls.setdefault(sid, []).append(body.count)
        return IncrementCounterResponse(success=True)

    async def get_counter_value(self, request: Request) -> GetCounterValueResponse:
        return GetCounterValueResponse(count=self.session_id_to_counter.get(self._sid(request), 0))

    async def verify(self, request: Request, body: CounterVerifyRequest) -> CounterVerifyResponse:
        sid = self._sid(request)
        counter = self.session_id_to_counter.get(sid, 0)
        self.session_id_to_verifies[sid] = self.session_id_to_verifies.get(sid, 0) + 1
        return CounterVerifyResponse(
            **body.model_dump(),
            reward=float(counter == body.expected_count),
            counter=counter,
            calls=len(self.session_id_to_calls.get(sid, [])),
        )

    async def sessions(self) -> dict:
        return {
            sid: {
                "count": c,
                "calls": self.session_id_to_calls.get(sid, []),
                "seeds": self.session_id_to_seeds.get(sid, 0),
                "verifies": self.session_id_to_verifies.get(sid, 0),
                "closed": sid in self.closed,
                "episode_id": self.session_id_to_episode.get(sid),
            }
            for sid, c in self.session_id_to_counter.items()
        }


if not TYPED:  # 0.4 has no /close_session: the route is not added (it answers 404)
    del CounterResourcesServer.close_resources_session


class JudgeVerifyRequest(BaseVerifyRequest):
    answer: str
    judge_url: str = ""


class JudgeResourcesServer(SimpleResourcesServer):
    """A judged task (0.7): see the module's docstring."""

    verified: int = 0

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.get("/_sessions")(self.sessions)
        return app

    async def sessions(self) -> dict:
        return {"verified": self.verified}

    async def _judge(self, url: str, text: str, answer: str) -> float:
        if url:  # a judge model server; unreachable here when the row says so
            _reader, writer = await asyncio.open_connection(*url.rsplit(":", 1))
            writer.close()
        return float(text.strip() == answer)

    async def verify(self, body: JudgeVerifyRequest) -> Any:
        self.verified += 1
        text = "".join(
            getattr(part, "text", "")
            for item in body.response.output
            if getattr(item, "type", None) == "message"
            for part in item.content
        )
        correct = await reraise_judge_errors(self._judge(body.judge_url, text, body.answer))
        fmt = float(bool(text.strip()))
        return BaseMultiRewardVerifyResponse(
            **body.model_dump(),
            reward=0.5 * fmt + 0.5 * correct,
            reward_components={"format": fmt, "correct": correct},
        )


class CopyVerifyRequest(BaseVerifyRequest):
    answer: list[str]


class CopyVerifyResponse(BaseVerifyResponse):
    answer: list[str]
    hits: int


class CopyResourcesServer(SimpleResourcesServer):
    verified: int = 0

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.get("/_sessions")(self.sessions)  # what the driver polls to see the server is up
        return app

    async def sessions(self) -> dict:
        return {"verified": self.verified}

    async def verify(self, body: CopyVerifyRequest) -> CopyVerifyResponse:
        text = ""
        for item in body.response.output:
            if (
                getattr(item, "type", None) == "message"
                and getattr(item, "role", "") == "assistant"
            ):
                text = "".join(getattr(part, "text", "") for part in item.content)
        self.verified += 1
        words = text.split()
        hits = sum(1 for i, a in enumerate(body.answer) if i < len(words) and words[i] == a)
        return CopyVerifyResponse(**body.model_dump(), reward=hits / len(body.answer), hits=hits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--kind", default="counter", help="counter, copy, judge or shipped:M:C")
    args = ap.parse_args()
    client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
        global_config_dict=OmegaConf.create({}),
    )
    if args.kind.startswith("shipped:"):
        _, module, name = args.kind.split(":")
        cls = getattr(importlib.import_module(module), name)
        config_cls = cls.model_fields["config"].annotation
    else:
        cls = {"counter": CounterResourcesServer, "copy": CopyResourcesServer,
               "judge": JudgeResourcesServer}[args.kind]  # fmt: skip
        config_cls = BaseResourcesServerConfig
    config = config_cls(host="127.0.0.1", port=args.port, entrypoint="servers.py", name="srv")
    app = cls(config=config, server_client=client).setup_webserver()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
