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


class PolicyRequest(msgspec.Struct, kw_only=True):
    task: Task
    items: list[Item]
    tools: list[FunctionTool]
    state: Any = None  # the environment's decoded state (the scripted policy reads it)
    turn: int = 0
    max_new_tokens: int = 0  # 0: the backend's default


class PolicyError(RuntimeError):
    """The backend could not answer (server down, out of memory): an infrastructure failure.
    The episode is left pending and retried; it is never scored."""


class Policy(ABC):
    name: str = ""

    @property
    def version(self) -> int:
        """The policy version that is answering now."""
        return 0

    @abstractmethod
    async def respond(self, request: PolicyRequest) -> ModelTurn: ...

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass
