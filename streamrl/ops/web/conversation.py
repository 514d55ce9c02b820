"""An episode's Responses items as the rows of a conversation: who spoke, what, which policy
version wrote it, and what went wrong (a tool call whose arguments are not JSON, a tool that
answered ``error: ...``). Plain data for the templates, which escape every string."""

from __future__ import annotations

import json
from dataclasses import dataclass

from streamrl import schema

FOLD_CHARS = 600  # longer text is folded (a summary line, the rest behind a click)
FOLD_LINES = 12


@dataclass
class Turn:
    kind: str  # message, reasoning, function_call, function_call_output
    role: str  # user, assistant, system, developer, tool
    text: str
    name: str = ""  # the tool called, or answering
    call_id: str = ""
    error: str = ""  # what is wrong with it, shown next to it
    version: int | None = None  # the policy version that wrote it (model items)
    turn: int | None = None  # the model turn it belongs to
    is_input: bool = False  # part of the task's input, not the episode

    @property
    def folded(self) -> bool:
        return len(self.text) > FOLD_CHARS or self.text.count("\n") >= FOLD_LINES

    @property
    def summary(self) -> str:
        first = self.text.strip().split("\n", 1)[0]
        return (first[:120] + " …") if len(first) > 120 else first


def _pretty(arguments: str) -> tuple[str, str]:
    """Tool-call arguments indented when they are a JSON object, else as written, with why."""
    try:
        value = json.loads(arguments)
    except ValueError as e:
        return arguments, f"arguments are not JSON: {e}"
    if not isinstance(value, dict):
        return arguments, "arguments are not a JSON object"
    return json.dumps(value, indent=2, ensure_ascii=False), ""


def _owners(traj: schema.Trajectory) -> dict[int, schema.ModelTurn]:
    """Item index -> the model turn that produced it, matching each turn's items in order."""
    out: dict[int, schema.ModelTurn] = {}
    at = traj.n_input
    for turn in traj.turns:
        for item in turn.items:
            j = at
            while j < len(traj.items) and traj.items[j] != item:
                j += 1
            if j == len(traj.items):
                break
            out[j] = turn
            at = j + 1
    return out


def conversation(traj: schema.Trajectory) -> list[Turn]:
    owners = _owners(traj)
    names: dict[str, str] = {}
    out: list[Turn] = []
    for i, item in enumerate(traj.items):
        owner = owners.get(i)
        where = {
            "version": owner.policy_version if owner else None,
            "turn": owner.index if owner else None,
            "is_input": i < traj.n_input,
        }
        if isinstance(item, schema.Message):
            out.append(Turn("message", item.role, item.content, **where))
        elif isinstance(item, schema.Reasoning):
            out.append(Turn("reasoning", "assistant", item.content, **where))
        elif isinstance(item, schema.FunctionCall):
            names[item.call_id] = item.name
            text, error = _pretty(item.arguments)
            out.append(
                Turn("function_call", "assistant", text, item.name, item.call_id, error, **where)
            )
        elif isinstance(item, schema.FunctionCallOutput):
            error = "the tool answered with an error" if item.output.startswith("error:") else ""
            name = names.get(item.call_id, "")
            out.append(Turn("function_call_output", "tool", item.output, name, item.call_id, error))
    return out
