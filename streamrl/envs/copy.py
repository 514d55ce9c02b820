"""``copy``: repeat three symbols back. The smallest task a tiny model can learn with RL.

The prompt is one user message ``copy : x y z`` with three symbols drawn uniformly (with
replacement) from ``a``..``p`` by the seeded generator; the answer is ``x y z``. No tools.

Reward: the fraction of the three positions whose word matches, comparing the whitespace-split
words of the final assistant message with the answer position by position; words after the
third are ignored, missing words count as wrong. Backends should put the completion into that
message decoded *without* skipping special tokens, so a stray ``<bos>`` is a wrong word rather
than silently vanishing (a trailing ``<eos>`` is the fourth word and is ignored).
Options: ``symbols`` (how many symbols to copy, default 3).
"""

from __future__ import annotations

import random
from typing import Annotated

import msgspec

from streamrl.envs.base import Environment, Prompt, Verdict, last_assistant_text, user
from streamrl.schema import Item, Message, Task, Trajectory

SYMBOLS = [chr(ord("a") + i) for i in range(16)]


class CopyState(msgspec.Struct):
    pass


class CopyEnv(Environment[CopyState]):
    name = "copy"
    version = "1"
    State = CopyState

    class Options(msgspec.Struct, kw_only=True):
        symbols: Annotated[int, msgspec.Meta(ge=1, le=64)] = 3

    tools = []

    def generate(self, rng: random.Random, index: int) -> Prompt:
        n = int(self.options.get("symbols", 3))
        answer = [rng.choice(SYMBOLS) for _ in range(n)]
        return Prompt([user("copy : " + " ".join(answer))], {"answer": answer})

    def reset(self, task: Task) -> CopyState:
        return CopyState()

    def verify(self, task: Task, trajectory: Trajectory, state: CopyState) -> Verdict:
        answer = list(task.data["answer"])
        words = last_assistant_text(trajectory.items).split()
        hits = [float(i < len(words) and words[i] == a) for i, a in enumerate(answer)]
        return Verdict(
            reward=sum(hits) / len(answer),
            components={f"pos{i}": h for i, h in enumerate(hits)},
            details={"expected": " ".join(answer), "answer": " ".join(words)[:64]},
        )

    def reference(self, task: Task, items: list[Item], state: CopyState) -> Item:
        return Message(role="assistant", content=" ".join(task.data["answer"]))

    def wrong(self, task: Task, items: list[Item], state: CopyState) -> Item:
        """The audit's plausible wrong answer: the copy with its last symbol changed, which
        the positional reward scores (n - 1) / n. No cheat may beat a near miss."""
        answer = list(task.data["answer"])
        last = answer[-1]
        answer[-1] = next(s for s in SYMBOLS if s != last)
        return Message(role="assistant", content=" ".join(answer))
