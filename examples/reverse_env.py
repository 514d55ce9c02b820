"""A complete environment in one file: reverse a word, with a tool that reads its letters."""

import random

import msgspec

from streamrl.envs import Environment, Prompt, StepResult, Verdict, last_assistant_text, user
from streamrl.schema import FunctionCall, FunctionTool, Message

WORDS = ["stream", "redis", "policy", "reward", "verifier", "rollout", "learner", "group"]


class State(msgspec.Struct):  # everything an episode knows; checkpointed after every turn
    word: str
    lookups: int = 0


class ReverseEnv(Environment[State]):
    name = "reverse"
    State = State
    tools = [
        FunctionTool(
            name="letter",
            description="The letter at a 0-based position of the word.",
            parameters={
                "type": "object",
                "properties": {"i": {"type": "integer"}},
                "required": ["i"],
            },
        )
    ]

    def generate(self, rng: random.Random, index: int) -> Prompt:
        word = rng.choice(WORDS)
        text = f"Reverse the word '{word}'. Reply with the reversed word only."
        return Prompt([user(text)], {"word": word})

    def reset(self, task) -> State:
        return State(word=task.data["word"])

    def step(self, state: State, name: str, arguments: dict) -> StepResult:
        i = arguments["i"]
        out = state.word[i] if 0 <= i < len(state.word) else "error: out of range"
        return StepResult(out, State(word=state.word, lookups=state.lookups + 1))

    def verify(self, task, trajectory, state: State) -> Verdict:
        ok = last_assistant_text(trajectory.items).strip() == task.data["word"][::-1]
        return Verdict(reward=float(ok), components={"exact": float(ok)})

    def reference(self, task, items, state: State):  # drives the scripted policy and audit
        if state.lookups == 0:
            return FunctionCall(call_id="c0", name="letter", arguments='{"i": 0}')
        return Message(role="assistant", content=state.word[::-1])
