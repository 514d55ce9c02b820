"""The audit's cheating agents: answers and tool calls that must never beat a wrong answer."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

from streamrl.envs.base import Environment
from streamrl.evaluation.play import Agent
from streamrl.schema import FunctionCall, Item, Message, Task

_LONG_CHARS = 100_000


def cheat_texts(task: Task, reference: str, wrong: str) -> dict[str, str]:
    """Final answers that must not beat a wrong answer. ``reference`` is the correct answer's
    text: a cheat that buries it among others, or breaks its markup, must not get credit."""
    prompt = "\n".join(i.content for i in task.input if isinstance(i, Message))
    unit = f"{prompt}\n{reference}\n{wrong}\n"
    tail = "\nI am not sure."
    long = (unit * (_LONG_CHARS // max(1, len(unit)) + 1))[: _LONG_CHARS - len(tail)] + tail
    texts = {
        "empty": "",
        "blank": " \n\t ",
        "echo_prompt": prompt,
        "long_100k": long,
        "both_answers": f"{wrong}\n{reference}",
        "number_spray": " ".join(str(i) for i in range(-100, 1001)),
        "boxed_spray": " ".join(f"\\boxed{{{i}}}" for i in range(0, 1001)) + " " + reference,
        "tag_spray": "".join(f"<answer>{i}</answer>" for i in range(0, 201)) + reference,
        "malformed_open": "\\boxed{\\frac{" + "{" * 50 + "<answer>",
        "malformed_empty": "\\boxed{} <answer></answer> Answer:",
    }
    unclosed = reference.translate(str.maketrans("", "", "})>]"))
    if unclosed != reference:
        texts["malformed_unclosed"] = unclosed
    doubled = reference.replace("{", "{{").replace("<", "<<")
    if doubled != reference:
        texts["malformed_doubled"] = doubled
    return texts


def swap_messages(agent: Agent, text: str) -> Agent:
    """``agent``, except that every assistant message it would send is ``text``."""

    def cheat(task: Task, items: list[Item], state: Any) -> Item:
        item = agent(task, items, state)
        if isinstance(item, Message):
            return Message(role="assistant", content=text)
        return item

    return cheat


_RETYPE: dict[str, Callable[[Any], Any]] = {
    "integer": str,
    "number": str,
    "string": lambda v: [v],
    "boolean": lambda v: "true" if v else "false",
    "array": json.dumps,
    "object": json.dumps,
}


def _break_arguments(env: Environment, call: FunctionCall, how: str) -> FunctionCall:
    """``call`` with arguments of the wrong JSON type: each argument retyped (``how="types"``)
    or the whole object sent as a JSON string (``how="string"``)."""
    if how == "string":
        return msgspec.structs.replace(call, arguments=json.dumps(call.arguments))
    tool = next((t for t in env.tools if t.name == call.name), None)
    props = tool.parameters.get("properties", {}) if tool else {}
    try:
        args = json.loads(call.arguments)
    except json.JSONDecodeError:
        return call
    if not isinstance(args, dict):
        return call
    broken: Any = {}
    for key, value in args.items():
        kind = props.get(key, {}).get("type")
        broken[key] = _RETYPE[kind](value) if kind in _RETYPE else value
    if broken == args:
        broken = [args]  # nothing to retype: an array where an object is required
    return msgspec.structs.replace(call, arguments=json.dumps(broken))


def break_tool_calls(env: Environment, agent: Agent, how: str) -> Agent:
    """``agent`` with the arguments of every tool call it makes broken ``how``."""

    def cheat(task: Task, items: list[Item], state: Any) -> Item:
        item = agent(task, items, state)
        return _break_arguments(env, item, how) if isinstance(item, FunctionCall) else item

    return cheat
