"""Responses items <-> chat messages, and a model's raw completion text -> Responses items.

Shared by the ``hf`` backend (which renders messages with the tokenizer's chat template) and
the ``openai`` backend (which sends them to ``/v1/chat/completions``). Both parse the model's
text themselves instead of trusting a server-side tool parser, because a malformed tool call
must still reach the environment as a ``FunctionCall`` (whose output tells the model what it
did wrong) rather than vanish or crash the episode.

Tool calls are recognised in the Hermes format used by Qwen, SmolLM, Hermes and many others::

    <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>

and ``<think>...</think>`` at the start of a completion becomes a ``Reasoning`` item.
"""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from typing import Any

from streamrl.schema import FunctionCall, FunctionCallOutput, FunctionTool, Item, Message, Reasoning

_TOOL_CALL_OPEN = "<tool_call>"
_TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')


def to_messages(
    items: list[Item], *, arguments_as_dict: bool = False, inline_tool_calls: bool = False
) -> list[dict[str, Any]]:
    """Chat-completions messages for a Responses item list.

    Consecutive assistant output (reasoning, text, function calls) is merged into one
    assistant message, the way the model produced it in one turn. ``arguments_as_dict``:
    HF chat templates (Qwen, Llama 3) expect a dict and ``tojson`` it; the OpenAI wire format
    wants the JSON string. Arguments that do not parse stay a string either way.
    ``inline_tool_calls``: for a template that knows nothing of tools (SmolLM2's plain
    ChatML), calls are written into the assistant's text in the Hermes form the model is
    asked to answer in, so an earlier call (a few-shot example) is not silently dropped.
    """
    messages: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None  # the assistant message being assembled

    def assistant() -> dict[str, Any]:
        nonlocal current
        if current is None:
            current = {"role": "assistant", "content": ""}
            messages.append(current)
        return current

    for item in items:
        if isinstance(item, Reasoning):
            assistant()["reasoning_content"] = item.content
        elif isinstance(item, FunctionCall) and inline_tool_calls:
            msg = assistant()
            msg["content"] += hermes_call(item)
        elif isinstance(item, FunctionCall):
            args: Any = item.arguments
            if arguments_as_dict:
                with contextlib.suppress(ValueError):
                    args = json.loads(item.arguments)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": args},
            }
            assistant().setdefault("tool_calls", []).append(call)
        elif isinstance(item, Message) and item.role == "assistant":
            msg = assistant()
            msg["content"] = (msg["content"] + item.content) if msg["content"] else item.content
        else:
            current = None
            if isinstance(item, FunctionCallOutput):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.output}
                )
            else:
                messages.append({"role": item.role, "content": item.content})
    return messages


def to_tools(tools: list[FunctionTool]) -> list[dict[str, Any]]:
    """Chat-completions ``tools`` (the nested ``function`` form both HF and vLLM expect)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


def hermes_call(call: FunctionCall) -> str:
    """A call as the model writes it: ``<tool_call>{"name": ..., "arguments": {...}}``."""
    try:
        args: Any = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        args = call.arguments
    body = json.dumps({"name": call.name, "arguments": args}, ensure_ascii=False)
    return f"{_TOOL_CALL_OPEN}{body}{_TOOL_CALL_CLOSE}"


def tool_prompt(tools: list[FunctionTool]) -> str:
    """The tools described in words, for a chat template that cannot take ``tools``: one line
    per tool with its parameters, and the call format ``parse_completion`` reads. Kept short
    on purpose: every prompt token is paid for in every turn a small model samples and trains.
    """
    lines = ["You can call tools. Tools:"]
    for t in tools:
        params = ", ".join((t.parameters or {}).get("properties", {}))
        desc = f": {t.description}" if t.description else ""
        lines.append(f"- {t.name}({params}){desc}")
    lines.append(
        f'To call a tool, write only: {_TOOL_CALL_OPEN}{{"name": "TOOL", "arguments": {{...}}}}'
        f"{_TOOL_CALL_CLOSE}"
    )
    return "\n".join(lines)


def with_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """``text`` put first in the system message (one is added when there is none)."""
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{text}\n{messages[0]['content']}".rstrip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def call_id(turn: int, index: int) -> str:
    """Deterministic per episode (a resumed episode re-creates the same ids)."""
    return f"call_{turn}_{index}"


def _parse_tool_call(raw: str, cid: str) -> FunctionCall:
    """One ``<tool_call>`` body -> FunctionCall; anything malformed keeps the raw text as
    ``arguments`` so the environment's argument validation answers the model."""
    body = raw.strip()
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return FunctionCall(call_id=cid, name=obj["name"], arguments=arguments)
    m = _NAME.search(body)
    return FunctionCall(call_id=cid, name=m.group(1) if m else "", arguments=body)


def parse_completion(text: str, turn: int) -> list[Item]:
    """The model's decoded completion (final eos already removed) -> Responses items.

    Text outside tool-call tags becomes one assistant ``Message`` placed before the calls;
    an empty completion still yields an (empty) assistant message so a turn is never empty.
    Special tokens the model emitted (a stray ``<bos>``) are left in the text on purpose:
    verifiers may rely on seeing them.
    """
    items: list[Item] = []
    m = _THINK.match(text)
    if m:
        items.append(Reasoning(content=m.group(1).strip()))
        text = text[m.end() :]
    calls = [
        _parse_tool_call(body, call_id(turn, i)) for i, body in enumerate(_TOOL_CALL.findall(text))
    ]
    rest = _TOOL_CALL.sub("", text).strip()
    if rest or not calls:
        items.append(Message(role="assistant", content=rest))
    items.extend(calls)
    return items


def since_model(items: list[Item]) -> int:
    """Where the items an episode added after its last model turn begin (tool outputs, a
    user's or system's reply); ``len(items)`` when nothing came since."""
    cut = len(items)
    while cut and (
        isinstance(items[cut - 1], FunctionCallOutput)
        or (isinstance(items[cut - 1], Message) and items[cut - 1].role != "assistant")
    ):
        cut -= 1
    return cut


def request_seed(base: int, task_id: str, turn: int) -> int:
    """A sampling seed that is a pure function of (base seed, task, turn), so re-running an
    episode on the same weights samples the same tokens where the backend allows it."""
    return zlib.crc32(f"{base}:{task_id}:{turn}".encode()) & 0x7FFFFFFF
