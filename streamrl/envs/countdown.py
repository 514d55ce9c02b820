"""``countdown``: reach a target number from given numbers with ``+ - * /``.

Every task is solvable: the generator builds the target from a random expression over some of
the numbers (positive intermediates, exact divisions), keeps that expression as the reference
solution, and never makes the target one of the numbers. Options: ``count`` (numbers per task,
3 to 6, default 4), ``max_target`` (default 999).

Reward: see ``streamrl.verifiers.countdown``: 1.0 for a rule-abiding expression equal to the
target, 0.1 for a rule-abiding one that misses, 0.0 otherwise. Single turn, no tools.
"""

from __future__ import annotations

import random
from typing import Annotated, Any

import msgspec

from streamrl.envs.base import Environment, Prompt, Verdict, last_assistant_text, user
from streamrl.schema import Item, Message, Task, Trajectory
from streamrl.verifiers import countdown as checker

_PROMPT = (
    "Using the numbers {numbers}, write an expression that equals {target}. You may use "
    "+, -, * and / and parentheses; each number may be used at most once, not every number "
    "has to be used, and every division must be exact. Think it through, then give only the "
    "expression inside <answer></answer> tags."
)


class CountdownState(msgspec.Struct):
    """Nothing changes during a single-turn episode."""


def _combine(rng: random.Random, a: tuple[int, str], b: tuple[int, str]) -> tuple[int, str] | None:
    (x, ex), (y, ey) = a, b
    op = rng.choice("+-*/")
    if op == "+":
        return x + y, f"({ex} + {ey})"
    if op == "-":
        return (x - y, f"({ex} - {ey})") if x > y else (y - x, f"({ey} - {ex})")
    # every sub-expression is parenthesized: "a * b / c" read left to right is not the
    # "a * (b / c)" that was built, and its division need not be exact (prompt 640 of seed 0)
    if op == "*":
        return (x * y, f"({ex} * {ey})") if min(x, y) > 1 and x * y <= 10_000 else None
    if y > 1 and x % y == 0:
        return x // y, f"({ex} / {ey})"
    if x > 1 and y % x == 0:
        return y // x, f"({ey} / {ex})"
    return None


def _unwrap(expression: str) -> str:
    """``expression`` without parentheses around all of it."""
    depth = 0
    for i, ch in enumerate(expression):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0 and i < len(expression) - 1:
            return expression  # the first "(" closes before the end
    return expression[1:-1] if expression.startswith("(") else expression


def make_puzzle(rng: random.Random, count: int, max_target: int) -> tuple[list[int], int, str]:
    """(numbers, target, a solution), by combining a random subset of numbers at random."""
    for _ in range(1000):
        numbers = [rng.randint(1, 99) for _ in range(count - 1)] + [rng.choice([25, 50, 75, 100])]
        rng.shuffle(numbers)
        pool = [(n, str(n)) for n in rng.sample(numbers, rng.randint(max(2, count - 2), count))]
        while len(pool) > 1:
            a, b = pool.pop(rng.randrange(len(pool))), pool.pop(rng.randrange(len(pool)))
            pool.append(_combine(rng, a, b) or (a[0] + b[0], f"({a[1]} + {b[1]})"))
        target, solution = pool[0]
        if 10 <= target <= max_target and target not in numbers:
            solution = _unwrap(solution)
            checker.evaluate(solution, numbers)  # the generator's own rules check
            return numbers, target, solution
    raise RuntimeError("could not make a countdown puzzle; raise max_target")


class CountdownEnv(Environment[CountdownState]):
    name = "countdown"
    version = "1"
    State = CountdownState

    class Options(msgspec.Struct, kw_only=True):
        count: Annotated[int, msgspec.Meta(ge=3, le=6)] = 4  # numbers per puzzle
        max_target: Annotated[int, msgspec.Meta(ge=1)] = 999

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.count = self.options["count"]
        self.max_target = self.options["max_target"]

    def generate(self, rng: random.Random, index: int) -> Prompt:
        numbers, target, solution = make_puzzle(rng, self.count, self.max_target)
        text = _PROMPT.format(numbers=", ".join(map(str, numbers)), target=target)
        return Prompt([user(text)], {"numbers": numbers, "target": target, "solution": solution})

    def reset(self, task: Task) -> CountdownState:
        return CountdownState()

    def verify(self, task: Task, trajectory: Trajectory, state: CountdownState) -> Verdict:
        text = last_assistant_text(trajectory.items)
        return checker.score(text, list(task.data["numbers"]), int(task.data["target"]))

    def reference(self, task: Task, items: list[Item], state: CountdownState) -> Item:
        return Message(role="assistant", content=f"<answer>{task.data['solution']}</answer>")

    def wrong(self, task: Task, items: list[Item], state: CountdownState) -> Item:
        """A rule-abiding miss (the first number alone): the best a wrong answer can score."""
        return Message(role="assistant", content=f"<answer>{task.data['numbers'][0]}</answer>")
