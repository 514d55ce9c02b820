"""Countdown answers: a safe parser for ``+ - * /`` expressions over the given numbers.

Rules an answer must follow (the prompt states them too):

- integers, ``+ - * /`` (also ``× · ÷ −``) and parentheses only; no unary minus, no joining
  digits of two numbers into one;
- each given number used at most once (a number given twice may be used twice); not every
  number has to be used;
- every division must be exact: ``a / b`` needs ``b != 0`` and ``a`` a multiple of ``b``, so all
  intermediate values are integers (they may be negative);
- a trailing ``= N`` is allowed when ``N`` is the target.

Reward (``score``): 1.0 when the response's final answer (see ``verifiers.answers``; all of its
candidates must be the same expression) follows the rules and equals the target; 0.1
(``VALID_CREDIT``, as in TinyZero's format score) when it follows the rules but misses; 0.0
otherwise (no answer, several different answers, a rule broken).
"""

from __future__ import annotations

import re
from collections import Counter

from streamrl.verifiers.answers import final_answers
from streamrl.verifiers.verdict import Verdict

VALID_CREDIT = 0.1
_MAX_CHARS = 200

_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
_SYMBOLS = str.maketrans({"×": "*", "·": "*", "÷": "/", "−": "-"})


class RuleError(ValueError):
    """The expression breaks a rule; the message says which."""


class _Evaluator:
    def __init__(self, text: str, numbers: list[int]):
        self.tokens: list[str] = []
        pos, text = 0, text.translate(_SYMBOLS).strip()
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if m is None:
                raise RuleError(f"unexpected {text[pos:].strip()[:10]!r}")
            self.tokens.append(m.group(1) or m.group(2))
            pos = m.end()
        self.i, self.depth = 0, 0
        self.left = Counter(numbers)

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise RuleError("the expression ends too early")
        self.i += 1
        return tok

    def expr(self) -> int:
        self.depth += 1
        if self.depth > 50:
            raise RuleError("nested too deeply")
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.take()
            value = value + self.term() if op == "+" else value - self.term()
        self.depth -= 1
        return value

    def term(self) -> int:
        value = self.factor()
        while self.peek() in ("*", "/"):
            op = self.take()
            right = self.factor()
            if op == "*":
                value *= right
            elif right == 0 or value % right:
                raise RuleError(f"{value} / {right} is not an exact division")
            else:
                value //= right
        return value

    def factor(self) -> int:
        tok = self.take()
        if tok == "(":
            value = self.expr()
            if self.take() != ")":
                raise RuleError("unbalanced parentheses")
            return value
        if not tok.isdigit():
            raise RuleError(f"expected a number, got {tok!r}")
        n = int(tok)
        if self.left[n] <= 0:
            raise RuleError(f"{n} is not one of the numbers, or is used too often")
        self.left[n] -= 1
        return n


def evaluate(expression: str, numbers: list[int], target: int | None = None) -> int:
    """The value of ``expression`` under the rules above; ``RuleError`` says what is wrong."""
    if len(expression) > _MAX_CHARS:
        raise RuleError("too long")
    lhs, eq, rhs = expression.partition("=")
    if eq:
        if rhs.strip() != str(target):
            raise RuleError(f"'= {rhs.strip()[:10]}' is not '= {target}'")
        expression = lhs
    ev = _Evaluator(expression, numbers)
    if not ev.tokens:
        raise RuleError("empty")
    value = ev.expr()
    if ev.peek() is not None:
        raise RuleError(f"unexpected {ev.peek()!r}")
    return value


def score(response: str, numbers: list[int], target: int) -> Verdict:
    """The countdown reward (see the module docstring)."""
    answers = final_answers(response)
    distinct = {re.sub(r"\s+", "", a) for a in answers}
    valid = exact = False
    if not answers:
        why = "no answer"
    elif len(distinct) > 1:
        why = f"{len(distinct)} different answers"
    else:
        try:
            value = evaluate(answers[0], numbers, target)
            valid, exact = True, value == target
            why = f"= {value}"
        except RuleError as e:
            why = str(e)
    reward = 1.0 if exact else VALID_CREDIT if valid else 0.0
    return Verdict(
        reward=reward,
        components={"valid": float(valid), "exact": float(exact)},
        details={"target": str(target), "answer": (answers[0] if answers else "")[:64], "why": why},
    )
