"""Later turns as token ids: how the ``openai`` backend continues an episode.

A chat completion has the server render the whole conversation again, the model's own earlier
words included, and re-tokenizing them need not give back the ids it sampled. The learner
then cannot lay an episode's turns end to end in one row: on ``lookup`` through vLLM, 65
learner rows for 88 turns, where the ``hf`` backend (which continues from the exact ids,
``hf.batching``) had 32 for 80. This is the same continuation for a server:

    the previous turn's prompt ids + its sampled ids (+ the end-of-turn token, if the turn
    was cut at its length) + only what came since (tool outputs, a user's reply)

where "what came since" is the server's own template's rendering, read with two
``POST /tokenize`` calls: the conversation up to the model's turn, and all of it with the
generation prompt. The second must extend the first up to that turn's end-of-turn token
(else the turn is rendered in full, as before: ``full_renders``); its ids after that token
are the new part. The prompt then goes to ``POST /v1/completions`` as token ids.

The end-of-turn token is learned from the server's own answers (the last id of a turn that
ended with ``stop``); until one is seen, and on a server without ``/tokenize`` (a 404: not
vLLM), turns are rendered in full.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from streamrl.policy import _chat
from streamrl.policy._openai_wire import ChatWire
from streamrl.policy.base import PolicyRequest
from streamrl.schema import ModelTurn

Post = Callable[..., Awaitable[tuple[Any, Any]]]


def continuation(
    previous: ModelTurn, before: list[int], full: list[int], eos: int
) -> list[int] | None:
    """The next prompt's ids (see the module), or None when ``full`` does not extend
    ``before`` up to its last end-of-turn token."""
    end = len(before) - 1 - before[::-1].index(eos) if eos in before else -1
    if end < 0 or full[: end + 1] != before[: end + 1]:
        return None
    ids = [*previous.prompt_token_ids, *previous.token_ids]
    if ids[-1] != eos:  # cut at its length: the template would have closed the turn
        ids.append(eos)
    return ids + full[end + 1 :]


class TokenContinuation:
    """One client's continuations: ``ids(request, model)`` or None (render in full)."""

    def __init__(self, wire: ChatWire, post: Post, enabled: bool = True) -> None:
        self.wire = wire
        self.post = post
        self.enabled = enabled
        self.eos: int | None = None  # learned from a turn that ended with ``stop``
        self.continued = 0  # later turns sent as token ids
        self.full_renders = 0  # later turns whose new template did not extend the old one

    def saw(self, turn: ModelTurn) -> None:
        if self.eos is None and turn.finish_reason == "stop" and turn.token_ids:
            self.eos = turn.token_ids[-1]

    async def ids(self, request: PolicyRequest, model: str) -> list[int] | None:
        prev = request.previous
        if not self.enabled or self.eos is None or prev is None or not prev.token_ids:
            return None
        if not prev.prompt_token_ids:
            return None
        cut = _chat.since_model(request.items)
        if cut == len(request.items):
            return None  # nothing came since the model's turn
        tokens = []
        for items, generation_prompt in ((request.items[:cut], False), (request.items, True)):
            body = self.wire.tokenize_body(
                request, items, model, generation_prompt=generation_prompt
            )
            data, _ = await self.post("/tokenize", body, optional=True)
            if data is None:  # not a vLLM server: render in full from now on
                self.enabled = False
                return None
            tokens.append([int(t) for t in data["tokens"]])
        ids = continuation(prev, tokens[0], tokens[1], self.eos)
        if ids is None:
            self.full_renders += 1
            return None
        self.continued += 1
        return ids
