"""``counter``: the smallest multi-turn tool environment, for tests and pipeline benchmarks.

The task: start at S, call ``add`` once per listed number, then answer with the final value.
With ``steps = T - 1`` an episode that follows the reference takes exactly T model turns.
Options: ``steps`` (tool calls per episode, default 2; 0 makes it single-turn), ``raise_on``
(the ``add`` tool raises for this number: a broken tool, for tests).
"""

from __future__ import annotations

import json
import random
from typing import Annotated

import msgspec

from streamrl.envs.base import Environment, Prompt, StepResult, Verdict, last_assistant_text, user
from streamrl.schema import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Item,
    Message,
    Task,
    Trajectory,
)


class CounterState(msgspec.Struct):
    value: int
    added: list[int] = []


class CounterEnv(Environment[CounterState]):
    name = "counter"
    version = "1"
    State = CounterState

    class Options(msgspec.Struct, kw_only=True):
        steps: Annotated[int, msgspec.Meta(ge=0, le=100)] = 2
        raise_on: int | None = None  # the add tool raises on this number (fault tests)

    tools = [
        FunctionTool(
            name="add",
            description="Add an integer to the counter; returns the new value.",
            parameters={
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            },
        )
    ]

    def generate(self, rng: random.Random, index: int) -> Prompt:
        steps = int(self.options.get("steps", 2))
        start = rng.randint(0, 99)
        numbers = [rng.randint(1, 20) for _ in range(steps)]
        if numbers:
            text = (
                f"The counter starts at {start}. Use the add tool to add each of these numbers "
                f"in order: {' '.join(map(str, numbers))}. Then reply with the final value only."
            )
        else:
            text = f"The counter starts at {start}. Reply with its value only."
        return Prompt([user(text)], {"start": start, "numbers": numbers})

    def reset(self, task: Task) -> CounterState:
        return CounterState(value=int(task.data["start"]))

    def step(self, state: CounterState, name: str, arguments: dict) -> StepResult:
        n = arguments["n"]
        if self.options.get("raise_on") is not None and n == self.options["raise_on"]:
            raise RuntimeError(f"the add tool broke on {n}")
        new = CounterState(value=state.value + n, added=[*state.added, n])
        return StepResult(str(new.value), new)

    def verify(self, task: Task, trajectory: Trajectory, state: CounterState) -> Verdict:
        expected = int(task.data["start"]) + sum(task.data["numbers"])
        answer = last_assistant_text(trajectory.items).strip()
        correct = answer == str(expected)
        followed = state.added == list(task.data["numbers"])
        return Verdict(
            reward=1.0 if correct and followed else 0.0,
            components={"answer": float(correct), "tool_use": float(followed)},
            details={"expected": str(expected), "answer": answer[:64]},
        )

    def reference(self, task: Task, items: list[Item], state: CounterState) -> Item:
        done = sum(isinstance(i, FunctionCallOutput) for i in items)
        numbers = task.data["numbers"]
        if done < len(numbers):
            return FunctionCall(
                call_id=f"call_{done}", name="add", arguments=json.dumps({"n": numbers[done]})
            )
        return Message(role="assistant", content=str(state.value))
