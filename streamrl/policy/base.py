"""The policy interface the rollout workers talk to.

A backend answers one turn of one episode. Backends that can batch (transformers, an HTTP
server) collect the concurrent requests of a worker's episodes themselves; the worker simply
awaits ``respond`` from many coroutines at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import msgspec

from streamrl.schema import FunctionTool, Item, ModelTurn, Task
from streamrl.session_codec import SessionTokens


class PolicyRequest(msgspec.Struct, kw_only=True):
    task: Task
    items: list[Item]
    tools: list[FunctionTool]
    state: Any = None  # the environment's decoded state (the scripted policy reads it)
    turn: int = 0
    max_new_tokens: int = 0  # 0: the backend's default
    # The episode's previous model turn: a backend that renders tokens itself continues from
    # its exact tokens instead of re-rendering (and re-tokenizing) what the model said.
    previous: ModelTurn | None = None


class PolicyError(RuntimeError):
    """The backend could not answer (server down, out of memory): an infrastructure failure.
    The episode is left pending and retried; it is never scored."""


class Policy(ABC):
    name: str = ""

    @property
    def version(self) -> int:
        """The policy version that is answering now."""
        return 0

    @property
    def reload_error(self) -> str | None:
        """Why the last attempt to load a newer policy version failed; None when it succeeded
        (or there was nothing to load). The rollout worker reports it with ``version``."""
        return None

    @property
    def server(self) -> str:
        """The server this worker's requests go to ('' for an in-process backend)."""
        return ""

    @property
    def requests(self) -> tuple[int, int]:
        """This worker's requests on the server now, and those waiting for one of its slots
        (``max_inflight_per_server``); reported in policy health."""
        return 0, 0

    def session_tokens(self) -> SessionTokens | None:
        """The tokenizer this policy samples with, for the session codec (text it can rebuild
        from a turn's token ids is not checkpointed twice); None: sessions keep all text."""
        return None

    @abstractmethod
    async def respond(self, request: PolicyRequest) -> ModelTurn: ...

    async def refresh(self) -> None:  # noqa: B027 - optional hook
        """Look for a newer policy version now. The rollout worker calls this at the start of
        a lease and on its heartbeat, so that a worker with nothing to generate still follows
        the learner (and reports it when it cannot). Backends that never change: nothing."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass
