"""What the ``openai`` backend sends and how it reads the answer: one chat completion request
per turn, and the ``ModelTurn`` read back from vLLM's response.

Requests. A first turn is one ``POST /v1/chat/completions`` (the server renders the chat
template, so this backend needs no tokenizer and no torch); a later one is ``POST
/v1/completions`` on the exact token ids so far (``_openai_tokens``), or a chat completion
where the server cannot tokenize. Besides the OpenAI fields it sends
vLLM's extensions (checked against vLLM's ``ChatCompletionRequest``/``ChatCompletionResponse``
in ``vllm/entrypoints/openai/chat_completion/protocol.py`` on vLLM's main branch, read through
a code index, not against a running release; ``return_token_ids`` is a 0.10-era addition):

- ``logprobs: true, top_logprobs: 0`` -> ``choices[0].logprobs.content[i].logprob``;
- ``return_token_ids: true`` -> ``prompt_token_ids`` (top level) and ``choices[0].token_ids``;
- ``return_tokens_as_token_ids: true`` -> each logprob entry's ``token`` is ``"token_id:N"``,
  our fallback for the ids on servers that predate ``return_token_ids``;
- ``skip_special_tokens: false`` so a stray ``<bos>`` stays in the text;
- ``top_k: -1, min_p: 0, repetition_penalty: 1, top_p: 1`` so the model's
  ``generation_config.json`` defaults cannot reshape the distribution, and a per-request
  ``seed`` from task id + turn.

Tool calls are parsed by us from the raw text (``<tool_call>`` JSON, see ``_chat``) with
``tool_choice: "none"``, which still renders the tools into the prompt. A malformed call thus
reaches the environment as a ``FunctionCall`` with the raw text as arguments. If the server
is started with its own tool parser and ``tool_choice`` is set to ``auto`` (option), parsed
``message.tool_calls`` are used as well. A chat template that knows nothing of tools
(SmolLM2's plain ChatML) drops ``tools`` silently, so the model never learns it has any:
``tool_prompt = "system"`` describes them in the system message instead and writes earlier
calls into the assistant's text, which is exactly what the ``hf`` backend renders for such a
template (its ``tool_prompt = "auto"``), so both backends show the model the same prompt.

Which policy version answered: see ``openai``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from streamrl.config import PolicyConfig
from streamrl.policy import _chat
from streamrl.policy.base import PolicyError, PolicyRequest
from streamrl.schema import FunctionCall, Item, Message, ModelTurn, Reasoning

_VERSION_HEADER = "x-policy-version"
_TOKEN_ID = re.compile(r"token_id:(\d+)")


@dataclass(frozen=True)
class _Answer:
    """What a chat or a text completion answered, read off either response's shape."""

    message: dict[str, Any]  # the chat message (server-parsed tool calls, reasoning); {} else
    content: str
    token_ids: list[Any]
    logprobs: list[float]
    finish: str | None
    prompt_ids: list[int]


@dataclass(frozen=True)
class ChatWire:
    """The request body and response parsing of one client (its options fixed at start)."""

    config: PolicyConfig
    seed: int = 0
    tool_choice: Any = "none"
    tool_prompt: str = "off"  # "system": tools in the system message, calls inline
    extra_body: dict[str, Any] = field(default_factory=dict)
    lora_prefix: str = "policy"
    _lora_answer: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tool_prompt not in ("off", "system"):
            raise ValueError(
                f"policy option tool_prompt must be off or system, not {self.tool_prompt!r}"
            )
        pattern = re.compile(rf"{re.escape(self.lora_prefix)}-v(\d+)")
        object.__setattr__(self, "_lora_answer", pattern)  # frozen: set once, here

    def _sampling(self, request: PolicyRequest, model: str) -> dict[str, Any]:
        return {
            "model": model,
            "max_tokens": request.max_new_tokens or self.config.max_new_tokens,
            "temperature": self.config.temperature,
            "top_p": 1.0,
            "top_k": -1,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "n": 1,
            "seed": _chat.request_seed(self.seed, request.task.task_id, request.turn),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }

    def body(self, request: PolicyRequest, model: str) -> dict[str, Any]:
        body = self._sampling(request, model)
        body.update(messages=self._messages(request, request.items), logprobs=True, top_logprobs=0)
        if request.tools and self.tool_prompt == "off":
            body["tools"] = _chat.to_tools(request.tools)
            body["tool_choice"] = self.tool_choice
        body.update(self.extra_body)
        return body

    def completion_body(self, request: PolicyRequest, ids: list[int], model: str) -> dict[str, Any]:
        """``POST /v1/completions`` on a prompt of token ids (``_openai_tokens``): the same
        sampling as ``body``; ``logprobs: 0`` is the sampled token's log-prob alone."""
        body = self._sampling(request, model)
        body.update(prompt=ids, logprobs=0)
        body.update(self.extra_body)
        return body

    def tokenize_body(
        self, request: PolicyRequest, items: list, model: str, *, generation_prompt: bool
    ) -> dict[str, Any]:
        """``POST /tokenize``: ``items`` rendered by the server's chat template as ``body``
        would send them."""
        body: dict[str, Any] = {
            "model": model,
            "messages": self._messages(request, items),
            "add_generation_prompt": generation_prompt,
        }
        if request.tools and self.tool_prompt == "off":
            body["tools"] = _chat.to_tools(request.tools)
        return body

    def _messages(self, request: PolicyRequest, items: list) -> list[dict[str, Any]]:
        if not (request.tools and self.tool_prompt == "system"):
            return _chat.to_messages(items)
        messages = _chat.to_messages(items, inline_tool_calls=True)
        return _chat.with_system(messages, _chat.tool_prompt(request.tools))

    def turn(
        self,
        request: PolicyRequest,
        data: dict[str, Any],
        headers: Any,
        sent_version: int,
        seconds: float,
    ) -> ModelTurn:
        """A chat completion read as a turn."""
        try:
            choice = data["choices"][0]
            message = choice.get("message") or {}
            entries = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(e["logprob"]) for e in entries]
            token_ids = choice.get("token_ids")
            if token_ids is None:
                token_ids = [int(_TOKEN_ID.fullmatch(e["token"]).group(1)) for e in entries]
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise PolicyError(f"unexpected chat completion response ({e!r}): {data!r:.500}") from e
        prompt_ids = list(data.get("prompt_token_ids") or [])
        answer = _Answer(message, message.get("content") or "", token_ids, logprobs,
                         choice.get("finish_reason"), prompt_ids)  # fmt: skip
        return self._model_turn(request, answer, data, headers, sent_version, seconds)

    def completion_turn(
        self,
        request: PolicyRequest,
        data: dict[str, Any],
        headers: Any,
        sent_version: int,
        seconds: float,
        prompt_ids: list[int],
    ) -> ModelTurn:
        """A completion on token ids read as a turn: its text parsed as the model's items (tool
        calls included), its prompt the ids that were sent."""
        try:
            choice = data["choices"][0]
            lp = choice.get("logprobs") or {}
            logprobs = [float(x) for x in lp.get("token_logprobs") or []]
            token_ids = choice.get("token_ids")
            if token_ids is None:
                token_ids = [int(_TOKEN_ID.fullmatch(t).group(1)) for t in lp.get("tokens") or []]
            echoed = choice.get("prompt_token_ids")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise PolicyError(f"unexpected completion response ({e!r}): {data!r:.500}") from e
        if echoed is not None and list(echoed) != prompt_ids:
            raise PolicyError("the server's prompt token ids are not the ones sent")
        answer = _Answer({}, choice.get("text") or "", token_ids, logprobs,
                         choice.get("finish_reason"), prompt_ids)  # fmt: skip
        return self._model_turn(request, answer, data, headers, sent_version, seconds)

    def _model_turn(
        self,
        request: PolicyRequest,
        answer: _Answer,
        data: dict[str, Any],
        headers: Any,
        sent_version: int,
        seconds: float,
    ) -> ModelTurn:
        """Either endpoint's answer as a turn, once checked: as many log-probs as ids, and not
        aborted."""
        token_ids, logprobs = answer.token_ids, answer.logprobs
        if not token_ids or len(token_ids) != len(logprobs):
            raise PolicyError(
                f"the server returned {len(token_ids)} token ids and {len(logprobs)} log-probs; "
                "it must support logprobs and return_token_ids (a recent vLLM)"
            )
        if answer.finish == "abort":
            raise PolicyError("the server aborted the request (weights being swapped?)")
        return ModelTurn(
            index=request.turn,
            items=_items(answer.message, answer.content, request.turn),
            prompt_token_ids=answer.prompt_ids,
            token_ids=[int(t) for t in token_ids],
            logprobs=logprobs,
            policy_version=self._answered_by(data, headers, sent_version),
            finish_reason="length" if answer.finish == "length" else "stop",
            seconds=seconds,
        )

    def adapter(self, version: int) -> str:
        """The name a LoRA version is loaded under (and answers with)."""
        return f"{self.lora_prefix}-v{version}"

    def _answered_by(self, data: dict[str, Any], headers: Any, sent_version: int) -> int:
        m = self._lora_answer.fullmatch(str(data.get("model", "")))
        if m:
            return int(m.group(1))
        header = headers.get(_VERSION_HEADER) if headers is not None else None
        if header is not None and header.strip().isdigit():
            return int(header)
        return sent_version


def _items(message: dict[str, Any], content: str, turn: int) -> list[Item]:
    items = _chat.parse_completion(content, turn)
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if reasoning and not any(isinstance(i, Reasoning) for i in items):
        items.insert(0, Reasoning(content=reasoning))
    server_calls = message.get("tool_calls") or []
    if server_calls:
        own = sum(isinstance(i, FunctionCall) for i in items)
        items = [i for i in items if not (isinstance(i, Message) and not i.content)]
        for k, call in enumerate(server_calls):
            fn = call.get("function") or {}
            items.append(
                FunctionCall(
                    call_id=_chat.call_id(turn, own + k),
                    name=str(fn.get("name", "")),
                    arguments=str(fn.get("arguments") or ""),
                )
            )
    return items


class HTTPStatusError(PolicyError):
    """A non-retryable HTTP status, kept for the caller."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def label_version(label: Any) -> int:
    """vLLM's weight label as a policy version: ``"7"`` -> 7; its start-up label
    (``"default"``) -> 0, the base model."""
    text = str(label or "").strip()
    return int(text) if text.isdigit() else 0


def aborted(data: Any) -> bool:
    try:
        return data["choices"][0].get("finish_reason") == "abort"
    except (KeyError, IndexError, TypeError, AttributeError):
        return False
