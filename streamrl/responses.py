"""OpenAI Responses JSON <-> streamrl's items, the way NeMo Gym writes and reads them.

NeMo Gym rows carry ``responses_create_params`` (``input``, ``tools``, sampling settings) and,
for a finished rollout, ``response``: an OpenAI ``Response`` object whose ``output`` holds every
item after the input, the environment's ``function_call_output`` items included (its agent
appends them there). streamrl keeps messages as plain text, so content parts are joined on the
way in and written as one ``output_text`` part on the way out.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from streamrl.schema import FunctionCall, FunctionCallOutput, FunctionTool, Item, Message, Reasoning


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or not isinstance(p.get("text", ""), str):
                raise ValueError("content parts must be objects with a string `text`")
            parts.append(p.get("text", ""))
        return "".join(parts)
    raise ValueError(f"message content must be text or a list of parts, got {type(content)}")


def _item_from_json(raw: Any, where: str = "item") -> Item:
    """One Responses item (input or output form) as a streamrl item; ValueError says why not."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object, got {type(raw).__name__}")
    kind = raw.get("type", "message" if "role" in raw else None)
    try:
        if kind == "message":
            return Message(role=raw.get("role", "assistant"), content=_text(raw.get("content")))
        if kind == "function_call":
            return FunctionCall(
                call_id=str(raw["call_id"]), name=str(raw["name"]), arguments=raw["arguments"]
            )
        if kind == "function_call_output":
            out = raw["output"]
            return FunctionCallOutput(
                call_id=str(raw["call_id"]), output=out if isinstance(out, str) else _text(out)
            )
        if kind == "reasoning":
            summary = raw.get("summary") or raw.get("content") or []
            return Reasoning(content=_text(summary))
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{where} ({kind}): {e}") from None
    raise ValueError(f"{where}: unsupported item type {kind!r}")


def items_from_json(raw: Any, where: str = "input") -> list[Item]:
    if isinstance(raw, str):
        return [Message(role="user", content=raw)]
    if not isinstance(raw, list):
        raise ValueError(f"{where}: expected a string or a list of items")
    items = [_item_from_json(x, f"{where} item {i}") for i, x in enumerate(raw)]
    for i, item in enumerate(items):  # the Literal role, checked as the decoders check it
        try:
            msgspec.convert(msgspec.to_builtins(item), Item)
        except msgspec.ValidationError as e:
            raise ValueError(f"{where} item {i}: {e}") from None
    return items


def input_json(items: list[Item]) -> list[dict[str, Any]]:
    """Items in the Responses *input* form (what ``responses_create_params.input`` holds)."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, Message):
            out.append({"type": "message", "role": item.role, "content": item.content})
        elif isinstance(item, Reasoning):
            out.append(
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": item.content}]}
            )
        else:
            out.append(msgspec.to_builtins(item))
    return out


def _output_json(items: list[Item], prefix: str = "") -> list[dict[str, Any]]:
    """Items in the Responses *output* form (``response.output``), with the ids and statuses
    the OpenAI types require. Non-assistant messages (an environment's reply) keep the input
    form, as NeMo Gym's multi-turn agents write them."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        ident = f"{prefix}{i}"
        if isinstance(item, Message) and item.role == "assistant":
            out.append(
                {
                    "id": f"msg_{ident}",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": item.content, "annotations": []}],
                }
            )
        elif isinstance(item, FunctionCall):
            out.append(
                {
                    "id": f"fc_{ident}",
                    "type": "function_call",
                    "call_id": item.call_id,
                    "name": item.name,
                    "arguments": item.arguments,
                    "status": "completed",
                }
            )
        elif isinstance(item, Reasoning):
            out.append(
                {
                    "id": f"rs_{ident}",
                    "type": "reasoning",
                    "summary": [{"type": "summary_text", "text": item.content}],
                }
            )
        else:
            out.extend(input_json([item]))
    return out


def response_json(
    response_id: str,
    output: list[Item],
    created_at: float,
    model: str,
    tools: list[Any] | None = None,
    prefix: str = "",
    parallel_tool_calls: bool = True,
) -> dict[str, Any]:
    """A complete OpenAI ``Response`` object (the fields its pydantic type requires);
    ``parallel_tool_calls`` echoes the request's setting, as OpenAI's does (default true)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(created_at),
        "model": model,
        "status": "completed",
        "output": _output_json(output, prefix),
        "parallel_tool_calls": parallel_tool_calls,
        "tool_choice": "auto",
        "tools": list(tools or []),
    }


def tools_from_json(raw: Any) -> list[FunctionTool]:
    """``responses_create_params.tools`` -> function tools (other tool kinds are refused)."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ValueError("responses_create_params.tools must be a list")
    tools = []
    for i, t in enumerate(raw):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise ValueError(f"tool {i}: only function tools are supported, got {kind!r}")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise ValueError(f"tool {i}: a function tool needs a name")
        tools.append(
            FunctionTool(
                name=t["name"],
                description=str(t.get("description") or ""),
                parameters=dict(t.get("parameters") or {}),
            )
        )
    return tools


def row_to_prompt(line: str | bytes) -> tuple[list[Item], dict[str, Any], str]:
    """A JSONL row -> (input items, verifier data, prompt id or "").

    Accepted shapes: NeMo Gym rows (``responses_create_params.input`` as a string or a list of
    Responses items; every other top-level field becomes verifier data, and so do the params'
    other fields, ``tools`` included, under ``responses_create_params``), or plain rows with a
    ``prompt`` (string) or ``input`` (items). An optional ``id`` names the prompt (a NeMo Gym
    row keeps it among its fields too, with its type, for the server and for export) and
    ``env`` picks the environment for this row.
    """
    return dict_to_prompt(parse_row(line))


def parse_row(line: str | bytes) -> Any:
    """A JSONL line as JSON (ValueError saying why not: not UTF-8, not JSON, too deep)."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(
                f"not UTF-8: byte 0x{line[e.start]:02x} at column {e.start + 1}"
            ) from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e.msg} at column {e.colno}") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def dict_to_prompt(row: Any) -> tuple[list[Item], dict[str, Any], str]:
    """``row_to_prompt`` for a row already parsed (a JSONL line's, or a dataset's)."""
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    row = dict(row)
    params = row.pop("responses_create_params", None)
    raw_input = params.get("input") if isinstance(params, dict) else None
    if raw_input is None:
        raw_input = row.pop("input", None) or row.pop("prompt", None)
    if raw_input is None:
        raise ValueError("no prompt: need responses_create_params.input, input or prompt")
    if isinstance(raw_input, str):
        raw_input = [{"type": "message", "role": "user", "content": raw_input}]
    items = []
    for i, item in enumerate(raw_input if isinstance(raw_input, list) else [raw_input]):
        if isinstance(item, dict) and "type" not in item and "role" in item:
            item = {"type": "message", **item}
        if isinstance(item, dict) and isinstance(item.get("content"), list):
            try:  # Responses content parts -> plain text
                item = {**item, "content": _text(item["content"])}
            except ValueError as e:
                raise ValueError(f"input item {i}: {e}") from None
        try:
            items.append(msgspec.convert(item, Item))
        except msgspec.ValidationError as e:
            raise ValueError(f"input item {i}: {e}") from None
    if not any(isinstance(x, Message) and x.content.strip() for x in items):
        raise ValueError("empty prompt: no message with text")
    own_id = row.pop("id", None)
    pid = "" if own_id is None or own_id == "" else str(own_id)
    if isinstance(params, dict) and own_id is not None:
        row["id"] = own_id  # a NeMo Gym row goes to its server whole, id included, as there
    if isinstance(params, dict) and set(params) - {"input"}:
        # tools and sampling settings: the nemo-gym environment offers these tools and sends
        # the whole params (input rebuilt from the task's items) to /seed_session and /verify
        row["responses_create_params"] = {k: v for k, v in params.items() if k != "input"}
    row.pop("response", None)
    row.pop("reward", None)
    return items, row, pid
