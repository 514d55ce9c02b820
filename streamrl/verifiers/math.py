"""Math answers: a small exact parser and the equivalence the ``math`` environment scores with.

``parse`` reads numbers (integers, decimals, ``1,234``), ``a/b``, ``\\frac{a}{b}``, one-letter
variables, ``+ - * / ^``, ``\\cdot``/``\\times``, parentheses and implicit products (``2x``,
``3(x+1)``) into a polynomial with exact rational coefficients, so ``1/2 == 0.5 ==
\\frac{1}{2}`` and ``2x+1 == 1+2x``. Decimals are exact (``0.33 != 1/3``); a trailing ``%``, a
``\\text{...}`` unit and a leading ``x =`` are ignored. When the expected answer is a number,
the answer must be written as one (``25``, ``-3/4``, ``\\frac{3}{4}``): ``17 + 8`` evaluates
to 25 but only restates the question. Likewise, when the expected answer is a polynomial
written in simplest form (unlike monomials, no parentheses: ``2x + 10``), the answer must be
too: ``3(x + 2) - x + 4`` has its value but is the question. A final equation
``17 + 8 = 25`` answers its right side, but only when it is true: a left side that is a number
must equal the right (``49 + 5 = 12`` answers nothing). It never calls ``eval``: unknown syntax,
division by a non-constant, exponents outside 0..64 and numbers past a size bound are parse
failures. An expected answer that does not parse (a dataset's "Paris") is compared as a
normalized string instead; when the expected answer parses, the answer must parse too.

Reward (``score``): 1.0 when the response has at least one final answer (see
``verifiers.answers``) and every one of them is equivalent to the expected answer, else 0.0.
"""

from __future__ import annotations

import re
from fractions import Fraction

from streamrl.verifiers.answers import final_answers
from streamrl.verifiers.verdict import Verdict

Monomial = tuple[tuple[str, int], ...]  # sorted (variable, power) pairs; () is the constant
Poly = dict[Monomial, Fraction]

_MAX_CHARS = 300
_MAX_DEPTH = 60
_MAX_POWER = 64
_MAX_BITS = 2048
_MAX_TERMS = 256


class ParseError(ValueError):
    pass


_REWRITES = [
    (re.compile(r"\\[dt]frac"), r"\\frac"),
    (re.compile(r"\\text\s*\{[^{}]*\}|\\(?:left|right)|\\[,;:! ]|~|\\?\$|\\?%"), " "),
    (re.compile(r"\\cdot|\\times|[×·∗]"), "*"),
    (re.compile(r"\\div|÷"), "/"),
    (re.compile(r"−"), "-"),
    (re.compile(r"\*\*"), "^"),
    (re.compile(r"(?<![\d.])(\d{1,3}(?:,\d{3})+)(?![\d,])"), lambda m: m.group(1).replace(",", "")),
]
_TOKEN = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|([A-Za-z]+)|(\\frac)|(\\[A-Za-z]+)|(\S))")
_ASSIGN = re.compile(r"^\s*[A-Za-z]\s*=(?!=)")


def _tokens(text: str) -> list[tuple[str, str]]:
    for pattern, repl in _REWRITES:
        text = pattern.sub(repl, text)
    text = _ASSIGN.sub("", text).strip().removesuffix(".")
    out: list[tuple[str, str]] = []
    for m in _TOKEN.finditer(text):
        num, word, frac, command, char = m.groups()
        if num is not None:
            out.append(("num", num))
        elif word is not None:
            if len(word) > 3:
                raise ParseError(f"word {word!r} in a math answer")
            out.extend(("var", c) for c in word)  # xy is x*y
        elif frac is not None:
            out.append(("frac", frac))
        elif command is not None:
            raise ParseError(f"unsupported command {command}")
        elif char in "+-*/^(){}":
            out.append(("op", char))
        else:
            raise ParseError(f"unexpected character {char!r}")
    return out


def _check(p: Poly) -> Poly:
    p = {k: v for k, v in p.items() if v}
    if len(p) > _MAX_TERMS:
        raise ParseError("too many terms")
    for v in p.values():
        if v.numerator.bit_length() > _MAX_BITS or v.denominator.bit_length() > _MAX_BITS:
            raise ParseError("number too large")
    return p


def _add(a: Poly, b: Poly, sign: int = 1) -> Poly:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, Fraction(0)) + sign * v
    return _check(out)


def _mul(a: Poly, b: Poly) -> Poly:
    out: Poly = {}
    for ka, va in a.items():
        for kb, vb in b.items():
            powers = dict(ka)
            for var, n in kb:
                powers[var] = powers.get(var, 0) + n
            k = tuple(sorted(powers.items()))
            out[k] = out.get(k, Fraction(0)) + va * vb
    return _check(out)


def _constant(p: Poly) -> Fraction | None:
    if not p:
        return Fraction(0)
    return p.get(()) if set(p) == {()} else None


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.i, self.depth = tokens, 0, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        tok = self.peek()
        if tok is None or (value is not None and tok[1] != value):
            raise ParseError(f"expected {value or 'more'} at token {self.i}")
        self.i += 1
        return tok

    def expr(self) -> Poly:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise ParseError("nested too deeply")
        p = self.term()
        while (tok := self.peek()) and tok[1] in "+-" and tok[0] == "op":
            self.take()
            p = _add(p, self.term(), 1 if tok[1] == "+" else -1)
        self.depth -= 1
        return p

    def term(self) -> Poly:
        p = self.unary()
        while tok := self.peek():
            if tok in (("op", "*"), ("op", "/")):
                self.take()
                q = self.unary()
                if tok[1] == "*":
                    p = _mul(p, q)
                else:
                    c = _constant(q)
                    if not c:
                        raise ParseError("division by zero or by a non-constant")
                    p = _mul(p, {(): 1 / c})
            elif tok[0] in ("var", "frac") or tok in (("op", "("), ("op", "{")):
                p = _mul(p, self.unary())  # implicit product: 2x, 3(x+1); never "2 3"
            else:
                break
        return p

    def unary(self) -> Poly:
        tok = self.peek()
        if tok in (("op", "-"), ("op", "+")):
            self.take()
            p = self.unary()
            return {k: -v for k, v in p.items()} if tok[1] == "-" else p
        return self.power()

    def power(self) -> Poly:
        base = self.atom()
        if self.peek() != ("op", "^"):
            return base
        self.take()
        n = _constant(self.unary())
        if n is None or n.denominator != 1 or not 0 <= n <= _MAX_POWER:
            raise ParseError("exponents must be whole numbers from 0 to 64")
        out: Poly = {(): Fraction(1)}
        for _ in range(int(n)):
            out = _mul(out, base)
        return out

    def group(self, close: str) -> Poly:
        p = self.expr()
        self.take(close)
        return p

    def atom(self) -> Poly:
        kind, value = self.take()
        if kind == "num":
            return _check({(): Fraction(value)})
        if kind == "var":
            return {((value, 1),): Fraction(1)}
        if kind == "frac":
            self.take("{")
            top = self.group("}")
            self.take("{")
            return self.divide(top, self.group("}"))
        if value == "(":
            return self.group(")")
        if value == "{":
            return self.group("}")
        raise ParseError(f"unexpected {value!r}")

    def divide(self, top: Poly, bottom: Poly) -> Poly:
        c = _constant(bottom)
        if not c:
            raise ParseError("division by zero or by a non-constant")
        return _mul(top, {(): 1 / c})


def parse(text: str) -> Poly:
    """``text`` as a polynomial with exact coefficients; ``ParseError`` if it is not one."""
    if len(text) > _MAX_CHARS:
        raise ParseError("too long to be an answer")
    parser = _Parser(_tokens(text))
    if parser.peek() is None:
        raise ParseError("empty")
    p = parser.expr()
    if parser.peek() is not None:
        raise ParseError(f"unexpected {parser.peek()[1]!r} after the expression")
    return _check(p)


def _normalize(text: str) -> str:
    """The string fallback for answers that are not math: case, blanks and wrappers dropped."""
    text = re.sub(r"\\text\s*\{([^{}]*)\}", r"\1", text)
    return re.sub(r"[\s$]+", "", text).lower().removesuffix(".")


def equivalent(answer: str, expected: str) -> bool:
    """Same polynomial when the expected answer parses (then the answer must parse too), else
    the same normalized string."""
    try:
        want = parse(expected)
    except ParseError:
        return bool(_normalize(answer)) and _normalize(answer) == _normalize(expected)
    try:
        answer = _equation_rhs(answer)
        if _constant(want) is not None and not _is_number(answer):
            return False  # "17 + 8" is the question, not its answer
        if (
            _constant(want) is None
            and _in_simplest_form(expected)
            and not _in_simplest_form(answer)
        ):
            return False  # "3(x + 2) - x + 4" restates "Simplify 3(x + 2) - x + 4."
        return parse(answer) == want
    except ParseError:
        return False


# a number written out, longest shape first (the first that matches is the whole number)
_NUMBER_SHAPES = (
    ("frac", "{", "num", "}", "{", "num", "}"),
    ("num", "/", "num"),
    ("num",),
)
_SIGNS = (("op", "-"), ("op", "+"))


def _number_end(toks: list[tuple[str, str]], i: int) -> int:
    """The index after a number written out at ``i`` (``3``, ``3/4``, ``\\frac{3}{4}``), or
    ``i`` when none starts there."""
    for shape in _NUMBER_SHAPES:
        got = tuple(k if k in ("num", "frac") else v for k, v in toks[i : i + len(shape)])
        if got == shape:
            return i + len(shape)
    return i


def _is_number(text: str) -> bool:
    """A number written out (``25``, ``-3/4``, ``0.75``, ``\\frac{3}{4}``), not an expression
    that evaluates to one: when the expected answer is a number, echoing the question's
    arithmetic must not count as answering it."""
    toks = _tokens(text)
    i = 1 if toks[:1] and toks[0] in _SIGNS else 0
    return i < len(toks) and _number_end(toks, i) == len(toks)


def _in_simplest_form(text: str) -> bool:
    """Written as a sum of unlike monomials, each a number times powers of distinct variables
    (``2x + 10``, ``x^2 - 3/4y``), with no parentheses and no two terms alike: the form a
    "simplify" question asks for. ``3(x + 2) - x + 4`` has the right value but is the question.
    """
    toks, seen = _tokens(text), set()

    def at(j: int) -> tuple[str, str] | None:
        return toks[j] if j < len(toks) else None

    def kind(j: int) -> str:
        return toks[j][0] if j < len(toks) else ""

    i = 1 if at(0) in _SIGNS else 0
    while True:
        start, i = i, _number_end(toks, i)
        if i > start and at(i) == ("op", "*") and kind(i + 1) == "var":
            i += 1
        powers: dict[str, str] = {}
        while kind(i) == "var":
            var = toks[i][1]
            if var in powers:
                return False  # "x x" is x^2 written as a product
            powers[var], i = "1", i + 1
            if at(i) == ("op", "^") and kind(i + 1) == "num":
                powers[var], i = toks[i + 1][1], i + 2
            if at(i) == ("op", "*") and kind(i + 1) == "var":
                i += 1
        if powers and at(i) == ("op", "/") and kind(i + 1) == "num":
            i += 2  # 2x/3
        if i == start:
            return False  # an empty term, or one that opens with "(" or an operator
        signature = tuple(sorted(powers.items()))
        if signature in seen:
            return False  # like terms left uncombined
        seen.add(signature)
        if at(i) is None:
            return True
        if at(i) not in _SIGNS:
            return False
        i += 1


_EQUALS = re.compile(r"(?<![<>!=])=(?!=)")


def _equation_rhs(answer: str) -> str:
    """The right side of ``lhs = rhs`` (small models state sums that way); ``ParseError`` when
    the left side is a constant the right side does not equal. ``x = 5`` is left to the
    parser, and anything that is not one equation is returned as it is."""
    sides = _EQUALS.split(answer)
    if len(sides) != 2 or _ASSIGN.match(answer):
        return answer
    lhs, rhs = sides
    try:
        left = parse(lhs)
    except ParseError:
        return rhs
    if _constant(left) is not None and left != parse(rhs):
        raise ParseError("the final equation is false")
    return rhs


def score(response: str, expected: str) -> Verdict:
    """The math reward (see the module docstring)."""
    answers = final_answers(response)
    correct = bool(answers) and all(equivalent(a, expected) for a in answers)
    shown = answers[0][:64] if len(answers) == 1 else f"{len(answers)} answers"
    return Verdict(
        reward=1.0 if correct else 0.0,
        components={"correct": float(correct), "answered": float(bool(answers))},
        details={"expected": expected[:64], "answer": shown},
    )
