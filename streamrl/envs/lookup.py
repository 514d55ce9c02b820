"""``lookup``: find a person's code with one tool, hand it in with another.

The smallest agentic task a 135M model can learn: two tool calls whose outputs matter. The
model calls ``lookup(name)`` for the person the user names, reads the code in the tool's
answer, and calls ``submit(code)``; submitting ends the episode. Codes are random per task, so
no answer can be guessed or memorised: it has to come from the lookup. The verifier checks
the episode's final state (the right person looked up, the right code submitted), never the
wording. Each prompt opens with one worked example (another person, another code), the way
few-shot tool prompts are written for small models.

Options: ``split`` (``train`` or ``heldout``: two disjoint sets of names, so held-out prompts
name people no training prompt named), ``people`` (entries in the task's directory: the
person asked for and others a wrong lookup may find).
"""

from __future__ import annotations

import json
import random
from typing import Annotated, Any, Literal

import msgspec

from streamrl.envs.base import Environment, Prompt, StepResult, ToolError, Verdict, user
from streamrl.schema import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Item,
    Message,
    Task,
    Trajectory,
)

TRAIN_NAMES = [
    "Mira",
    "Tomas",
    "Ines",
    "Oskar",
    "Leila",
    "Yusuf",
    "Greta",
    "Pavel",
    "Noor",
    "Emil",
    "Sofia",
    "Rafael",
    "Anika",
    "Jonas",
    "Talia",
    "Marco",
    "Elena",
    "Viktor",
    "Hanna",
    "Lucas",
    "Amira",
    "Felix",
    "Clara",
    "Dmitri",
    "Zara",
    "Hugo",
    "Lena",
    "Omar",
    "Ivy",
    "Bruno",
    "Selma",
    "Theo",
    "Priya",
    "Anton",
    "Maya",
    "Kenji",
    "Rosa",
    "Idris",
    "Vera",
    "Matteo",
    "Lina",
    "Samir",
    "Freya",
    "Diego",
    "Alma",
    "Nikolai",
    "Esme",
    "Tariq",
]
HELDOUT_NAMES = [
    "Nadia",
    "Lars",
    "Fatima",
    "Pedro",
    "Ingrid",
    "Kwame",
    "Yara",
    "Stefan",
    "Mei",
    "Tobias",
    "Leona",
    "Arjun",
    "Helga",
    "Rico",
    "Aisha",
    "Gustav",
    "Chiara",
    "Milan",
    "Sana",
    "Otto",
    "Lucia",
    "Ravi",
    "Elsa",
    "Malik",
    "Dora",
    "Jasper",
    "Nia",
    "Florin",
    "Keiko",
    "Anders",
    "Salma",
    "Boris",
    "Yasmin",
    "Ezra",
    "Petra",
    "Kofi",
    "Livia",
    "Henrik",
    "Zoe",
    "Imran",
    "Agnes",
    "Carlos",
    "Wanda",
    "Luka",
    "Farah",
    "Soren",
    "Nora",
    "Amos",
]
_EXAMPLE_NAME, _EXAMPLE_CODE = "Ana", 1234  # in neither list


def _question(name: str) -> str:
    return (
        f"What is the secret code of {name}? First call lookup with name {name}, "
        f"then call submit with the code."
    )


def _call(call_id: str, name: str, arguments: dict) -> FunctionCall:
    return FunctionCall(call_id=call_id, name=name, arguments=json.dumps(arguments))


def _example() -> list[Item]:
    return [
        user(_question(_EXAMPLE_NAME)),
        _call("example_0", "lookup", {"name": _EXAMPLE_NAME}),
        FunctionCallOutput(
            call_id="example_0", output=json.dumps({"name": _EXAMPLE_NAME, "code": _EXAMPLE_CODE})
        ),
        _call("example_1", "submit", {"code": _EXAMPLE_CODE}),
        FunctionCallOutput(call_id="example_1", output="submitted"),
    ]


class LookupState(msgspec.Struct):
    directory: dict[str, int] = {}  # name -> code, from the task
    looked_up: list[str] = []  # names found, in order
    submitted: int | None = None


def _tool(name: str, description: str, param: str, kind: str) -> FunctionTool:
    return FunctionTool(
        name=name,
        description=description,
        parameters={
            "type": "object",
            "properties": {param: {"type": kind}},
            "required": [param],
            "additionalProperties": False,
        },
    )


class LookupEnv(Environment[LookupState]):
    name = "lookup"
    version = "1"
    State = LookupState
    tools = [
        _tool("lookup", "returns the secret code of a person", "name", "string"),
        _tool("submit", "submits a code", "code", "integer"),
    ]

    class Options(msgspec.Struct, kw_only=True):
        split: Literal["train", "heldout"] = "train"
        people: Annotated[int, msgspec.Meta(ge=1, le=8)] = 3

    def generate(self, rng: random.Random, index: int) -> Prompt:
        pool = TRAIN_NAMES if self.options["split"] == "train" else HELDOUT_NAMES
        names = rng.sample(pool, self.options["people"])
        directory = {n: rng.randint(1000, 9999) for n in names}
        target = names[0]
        return Prompt([*_example(), user(_question(target))],
                      {"target": target, "directory": directory})  # fmt: skip

    def same_prompt_key(self, prompt: Prompt) -> Any:
        """A question names one of 48 people; the code the lookup answers with is the task."""
        return (prompt.input, prompt.data["directory"])

    def reset(self, task: Task) -> LookupState:
        return LookupState(directory={k: int(v) for k, v in task.data["directory"].items()})

    def step(self, state: LookupState, name: str, arguments: dict) -> StepResult:
        if name == "lookup":
            wanted = str(arguments["name"]).strip()
            found = {k.lower(): (k, v) for k, v in state.directory.items()}.get(wanted.lower())
            if found is None:
                raise ToolError(f"no person named {wanted!r}")
            who, code = found
            new = msgspec.structs.replace(state, looked_up=[*state.looked_up, who])
            return StepResult(json.dumps({"name": who, "code": code}), new)
        code = int(arguments["code"])
        if not -(2**63) <= code < 2**63:  # the state is msgpack: a larger int cannot be stored
            raise ToolError(f"code {str(code)[:12]}... is out of range")
        new = msgspec.structs.replace(state, submitted=code)
        return StepResult("submitted", new, done=True)

    def verify(self, task: Task, trajectory: Trajectory, state: LookupState) -> Verdict:
        target = task.data["target"]
        code = int(task.data["directory"][target])
        looked = target in state.looked_up
        right = state.submitted == code
        return Verdict(
            reward=1.0 if looked and right else 0.0,
            components={"lookup": float(looked), "submit": float(right)},
            details={
                "expected": str(code),
                "submitted": str(state.submitted),
                "looked_up": ", ".join(state.looked_up),
            },
        )

    def reference(self, task: Task, items: list[Item], state: LookupState) -> Item:
        return self._plan(task, items, 0)

    def wrong(self, task: Task, items: list[Item], state: LookupState) -> Item:
        """Looks the right person up and submits a code one off."""
        return self._plan(task, items, 1)

    def _plan(self, task: Task, items: list[Item], off: int) -> Item:
        done = sum(isinstance(i, FunctionCallOutput) for i in items[len(task.input) :])
        target = task.data["target"]
        if done == 0:
            return _call("call_0_0", "lookup", {"name": target})
        if done == 1:
            code = int(task.data["directory"][target]) + off
            return _call("call_1_0", "submit", {"code": code})
        return Message(role="assistant", content="done")
