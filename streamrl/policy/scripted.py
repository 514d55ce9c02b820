"""``scripted``: a deterministic, instant policy that plays the environment's reference agent.

For tests and for measuring the pipeline's own overhead. Mistakes are a pure function of the
task id, so every run of the same tasks gives the same trajectories: ``wrong_rate`` of the
samples end with a wrong final answer (so groups have reward variance) and ``malformed_rate``
of them start with a tool call whose arguments are not JSON. Option ``token_vocab`` (N > 0): each
turn also carries token ids (the bytes of its text and of the last input item, modulo N, at
most 32 each), so that a learner on a model with N tokens trains on a scripted run (``streamrl
bench soak``); behaviour log-probs stay unknown.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

import msgspec

from streamrl.config import PolicyConfig
from streamrl.envs.base import Environment
from streamrl.policy.base import Policy, PolicyRequest
from streamrl.schema import FunctionCall, Message, ModelTurn


def _fraction(task_id: str, salt: str) -> float:
    """A uniform number in [0, 1) from the task id. Not CRC32: it is affine, so ids that differ
    only in their last characters (the samples of one prompt) would get correlated values."""
    digest = hashlib.blake2b(f"{salt}:{task_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


class ScriptedPolicy(Policy):
    name = "scripted"

    def __init__(
        self,
        config: PolicyConfig,
        env: Environment,
        env_for: Callable[[str], Environment] | None = None,
    ):
        self.config = config
        self.env = env
        self.env_for = env_for  # the worker's per-task environments, for mixed runs
        self.token_vocab = int(config.options.get("token_vocab", 0))

    async def respond(self, request: PolicyRequest) -> ModelTurn:
        if self.config.latency_s > 0:
            await asyncio.sleep(self.config.latency_s)
        task = request.task
        env = self.env_for(task.env) if self.env_for is not None else self.env
        malformed = _fraction(task.task_id, "malformed") < self.config.malformed_rate
        if request.turn == 0 and malformed and request.tools:
            item = FunctionCall(call_id="call_bad", name=request.tools[0].name, arguments="{n: ")
        else:
            item = env.reference(task, request.items, request.state)
            if isinstance(item, Message) and _fraction(task.task_id, "wrong") < (
                self.config.wrong_rate
            ):
                item = Message(role="assistant", content=item.content + " (or so)")
        turn = ModelTurn(index=request.turn, items=[item])
        if self.token_vocab > 0:
            turn.prompt_token_ids = self._tokens(request.items[-1:]) or [0]
            turn.token_ids = self._tokens([item]) or [0]
        return turn

    def _tokens(self, items: list) -> list[int]:
        text = b"".join(msgspec.json.encode(i) for i in items)
        return [b % self.token_vocab for b in text[-32:]]
