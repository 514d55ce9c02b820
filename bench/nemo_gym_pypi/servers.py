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
"""

from __future__ import annotations

import argparse

import uvicorn
from fastapi import FastAPI, Request
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

    def setup_webserver(self) -> FastAPI:
        app = super().setup_webserver()
        app.post("/increment_counter")(self.increment_counter)
        app.post("/get_counter_value")(self.get_counter_value)
        app.get("/_sessions")(self.sessions)
        return app

    async def seed_session(
        self, request: Request, body: CounterSeedSessionRequest
    ) -> BaseSeedSessionResponse:
        sid = request.session[SESSION_ID_KEY]
        self.session_id_to_counter.setdefault(sid, body.initial_count)
        self.session_id_to_seeds[sid] = self.session_id_to_seeds.get(sid, 0) + 1
        return BaseSeedSessionResponse()

    async def increment_counter(
        self, request: Request, body: IncrementCounterRequest
    ) -> IncrementCounterResponse:
        sid = request.session[SESSION_ID_KEY]
        self.session_id_to_counter[sid] = self.session_id_to_counter.get(sid, 0) + body.count
        self.session_id_to_calls.setdefault(sid, []).append(body.count)
        return IncrementCounterResponse(success=True)

    async def get_counter_value(self, request: Request) -> GetCounterValueResponse:
        return GetCounterValueResponse(
            count=self.session_id_to_counter.get(request.session[SESSION_ID_KEY], 0)
        )

    async def verify(self, request: Request, body: CounterVerifyRequest) -> CounterVerifyResponse:
        sid = request.session[SESSION_ID_KEY]
        counter = self.session_id_to_counter.get(sid, 0)
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
            }
            for sid, c in self.session_id_to_counter.items()
        }


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
    ap.add_argument("--kind", choices=["counter", "copy"], default="counter")
    args = ap.parse_args()
    config = BaseResourcesServerConfig(
        host="127.0.0.1", port=args.port, entrypoint="servers.py", name=args.kind
    )
    client = ServerClient(
        head_server_config=BaseServerConfig(host="127.0.0.1", port=0),
        global_config_dict=OmegaConf.create({}),
    )
    cls = CounterResourcesServer if args.kind == "counter" else CopyResourcesServer
    app = cls(config=config, server_client=client).setup_webserver()
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
