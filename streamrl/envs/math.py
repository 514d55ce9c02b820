"""``math``: single-turn arithmetic, algebra and word problems with exact answers.

Tasks come from a seeded generator (kinds: arithmetic, fractions, linear equations,
simplification, and four word-problem templates) or, with the option ``dataset=PATH``, from a
JSONL file whose rows are ``{"question": str, "answer": str | number}`` (task ``index`` is row
``index % rows``; a bad row raises ``DatasetError`` naming its line). Option ``kinds`` (a list
or comma-separated names) restricts the generator.

Reward: see ``streamrl.verifiers.math``: 1.0 when every final answer the response gives
(``\\boxed{}``, ``<answer>`` tags, "Answer: ..." lines, else the last line) is equivalent to the
expected answer, else 0.0. No tools; the first assistant message ends the episode.
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

import msgspec

from streamrl.envs.base import Environment, Prompt, Verdict, last_assistant_text, user
from streamrl.schema import Item, Message, Task, Trajectory
from streamrl.verifiers import math as checker

_INSTRUCTION = "Put your final answer in \\boxed{}."
_NAMES = ["Maya", "Omar", "Lena", "Kenji", "Ana", "Tom", "Priya", "Felix"]


class DatasetError(ValueError):
    pass


class MathState(msgspec.Struct):
    """Nothing changes during a single-turn episode."""


def _fmt(x: Fraction) -> str:
    """An exact answer as people write it: 7, -3/4, 12.75 (two decimals at most)."""
    if x.denominator == 1:
        return str(x.numerator)
    if 100 % x.denominator == 0 or x.denominator == 8:
        return f"{float(x):.10g}"
    return f"{x.numerator}/{x.denominator}"


def _money(x: Fraction) -> str:
    return f"{float(x):.2f}"


def _hours(n: int) -> str:
    return f"{n} hour" if n == 1 else f"{n} hours"


def _arithmetic(rng: random.Random) -> tuple[str, str]:
    a, b, c, d = (rng.randint(2, 30) for _ in range(4))
    op1, op2 = rng.choice("+-"), rng.choice("+-")
    text = f"({a} {op1} {b}) * {c} {op2} {d}"
    value = (a + b if op1 == "+" else a - b) * c + (d if op2 == "+" else -d)
    return f"Compute {text}.", str(value)


def _fractions(rng: random.Random) -> tuple[str, str]:
    x = Fraction(rng.randint(1, 9), rng.randint(2, 9))
    y = Fraction(rng.randint(1, 9), rng.randint(2, 9))
    op = rng.choice("+-*")
    value = x + y if op == "+" else x - y if op == "-" else x * y
    question = f"Compute {x} {op} {y}. Give an exact answer (a fraction in lowest terms is fine)."
    return question, _fmt(value)


def _linear(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(2, 9), rng.randint(-20, 20)
    x = Fraction(rng.randint(-12, 12), rng.choice([1, 1, 1, a]))
    c = a * x + b
    sign = "+" if b >= 0 else "-"
    return f"Solve for x: {a}x {sign} {abs(b)} = {_fmt(c)}.", _fmt(x)


def _simplify(rng: random.Random) -> tuple[str, str]:
    a, b, c, d = rng.randint(2, 6), rng.randint(1, 9), rng.randint(1, 5), rng.randint(1, 20)
    # a(x + b) - cx + d = (a - c)x + (ab + d)
    coef, const = a - c, a * b + d
    x_part = "" if coef == 0 else "x" if coef == 1 else "-x" if coef == -1 else f"{coef}x"
    answer = f"{x_part} + {const}" if x_part else str(const)
    return f"Simplify {a}(x + {b}) - {c}x + {d}.", answer


def _change(rng: random.Random) -> tuple[str, str]:
    n, cents = rng.randint(2, 9), rng.randint(50, 900)
    bill = 50 if n * cents < 5000 else 100
    while n * cents >= bill * 100:
        n -= 1
    name, price = rng.choice(_NAMES), Fraction(cents, 100)
    question = (
        f"{name} buys {n} notebooks at ${_money(price)} each and pays with a ${bill} bill. "
        f"How many dollars of change does {name} get?"
    )
    return question, _fmt(bill - n * price)


def _apples(rng: random.Random) -> tuple[str, str]:
    k, each, more = rng.randint(2, 6), rng.randint(2, 8), rng.randint(1, 30)
    start = k * each + rng.randint(0, 40)
    name = rng.choice(_NAMES)
    question = (
        f"{name} has {start} apples, gives {each} to each of {k} friends and then picks "
        f"{more} more. How many apples does {name} have now?"
    )
    return question, str(start - k * each + more)


def _distance(rng: random.Random) -> tuple[str, str]:
    v, t, u, s = rng.randint(8, 30), rng.randint(1, 4), rng.randint(5, 25), rng.randint(1, 3)
    question = (
        f"A cyclist rides at {v} km/h for {_hours(t)}, then at {u} km/h for {_hours(s)}. "
        f"How many kilometres does she ride in total?"
    )
    return question, str(v * t + u * s)


def _split(rng: random.Random) -> tuple[str, str]:
    n = rng.randint(2, 8)
    total = Fraction(n * rng.randint(500, 5000), 100)
    question = (
        f"{n} friends split a bill of ${_money(total)} equally. How many dollars does each pay?"
    )
    return question, _fmt(total / n)


def _add(rng: random.Random) -> tuple[str, str]:
    """Two-number addition: easy enough that a 135M model partly solves it (the real-model
    benchmark's task), with 2,500 distinct prompts so held-out ones exist."""
    a, b = rng.randint(1, 50), rng.randint(1, 50)
    return f"What is {a} + {b}?", str(a + b)


KINDS = {
    "add": _add,
    "arithmetic": _arithmetic,
    "fractions": _fractions,
    "linear": _linear,
    "simplify": _simplify,
    "change": _change,
    "apples": _apples,
    "distance": _distance,
    "split": _split,
}


def load_dataset(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file of ``{"question", "answer"}``; blank lines are skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON: {e}") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{where}: a row must be a JSON object")
            question, answer = row.get("question"), row.get("answer")
            if not isinstance(question, str) or not question.strip():
                raise DatasetError(f"{where}: 'question' must be a non-empty string")
            if isinstance(answer, (int, float)) and not isinstance(answer, bool):
                answer = str(answer)
            if not isinstance(answer, str) or not answer.strip():
                raise DatasetError(f"{where}: 'answer' must be a non-empty string or a number")
            rows.append({"question": question, "answer": answer.strip(), "line": lineno})
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return rows


class MathEnv(Environment[MathState]):
    name = "math"
    # 2: a true final equation answers its right side; numbers written as numbers
    # 3: a polynomial expected in simplest form must be answered in simplest form
    version = "3"
    State = MathState

    class Options(msgspec.Struct, kw_only=True):
        dataset: str | None = None  # a JSONL file of problems instead of the generator
        kinds: str | list[str] | None = None  # generator kinds, a list or "a,b"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._rows = load_dataset(options["dataset"]) if options.get("dataset") else None
        kinds = options.get("kinds") or [k for k in KINDS if k != "add"]
        self._kinds = kinds.split(",") if isinstance(kinds, str) else list(kinds)
        unknown = set(self._kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown math kinds {sorted(unknown)}; known: {sorted(KINDS)}")

    def generate(self, rng: random.Random, index: int) -> Prompt:
        if self._rows is not None:
            row = self._rows[index % len(self._rows)]
            data = {"answer": row["answer"], "kind": "dataset", "line": row["line"]}
            return Prompt([user(f"{row['question']}\n\n{_INSTRUCTION}")], data)
        kind = self._kinds[index % len(self._kinds)]
        question, answer = KINDS[kind](rng)
        return Prompt([user(f"{question}\n\n{_INSTRUCTION}")], {"answer": answer, "kind": kind})

    def reset(self, task: Task) -> MathState:
        return MathState()

    def verify(self, task: Task, trajectory: Trajectory, state: MathState) -> Verdict:
        return checker.score(last_assistant_text(trajectory.items), str(task.data["answer"]))

    def reference(self, task: Task, items: list[Item], state: MathState) -> Item:
        return Message(role="assistant", content=f"The answer is \\boxed{{{task.data['answer']}}}.")

    def wrong(self, task: Task, items: list[Item], state: MathState) -> Item:
        """The expected answer plus one (or prefixed with "not" when it is not math)."""
        answer = str(task.data["answer"])
        try:
            checker.parse(answer)
            wrong = f"({answer}) + 1"
        except checker.ParseError:
            wrong = f"not {answer}"
        return Message(role="assistant", content=f"The answer is \\boxed{{{wrong}}}.")
