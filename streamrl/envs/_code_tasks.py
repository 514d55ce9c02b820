"""Function-writing task templates for the ``code`` environment.

Each template has a statement, a reference solution (source text: it is both what the
reference agent answers and, exec'd here in the trusted process, how expected outputs are
computed) and a seeded generator of argument lists. Outputs must be JSON values, because the
sandboxed harness reports them as JSON and the verifier compares canonical JSON text.
"""

from __future__ import annotations

import functools
import random
import string
from collections.abc import Callable
from typing import Any, NamedTuple


class Template(NamedTuple):
    function: str
    signature: str
    statement: str
    source: str
    args: Callable[[random.Random], list[Any]]


def _word(rng: random.Random, lo: int = 1, hi: int = 7) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def _palindrome_args(rng: random.Random) -> list[Any]:
    half = "".join(rng.choice("abcAB ,") for _ in range(rng.randint(0, 5)))
    text = half + rng.choice(["", "x", "Z"]) + half[::-1]
    if rng.random() < 0.5:
        text = text + rng.choice("qrs")
    return [text]


def _intervals_args(rng: random.Random) -> list[Any]:
    out = []
    for _ in range(rng.randint(0, 6)):
        a = rng.randint(0, 20)
        out.append([a, a + rng.randint(0, 5)])
    return [out]


TEMPLATES: list[Template] = [
    Template(
        "digit_sum",
        "digit_sum(n: int) -> int",
        "returns the sum of the decimal digits of the non-negative integer n",
        "def digit_sum(n):\n    return sum(int(c) for c in str(n))\n",
        lambda rng: [rng.randint(0, 10 ** rng.randint(1, 12))],
    ),
    Template(
        "reverse_words",
        "reverse_words(s: str) -> str",
        "returns the words of s (separated by runs of spaces) in reverse order, joined by "
        "single spaces",
        "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n",
        lambda rng: [
            "  ".join(_word(rng) for _ in range(rng.randint(0, 5))) + " " * rng.randint(0, 2)
        ],
    ),
    Template(
        "count_vowels",
        "count_vowels(s: str) -> int",
        "returns how many characters of s are vowels (a, e, i, o, u, either case)",
        "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)\n",
        lambda rng: ["".join(rng.choice("abeiOUxyz Q") for _ in range(rng.randint(0, 15)))],
    ),
    Template(
        "is_palindrome",
        "is_palindrome(s: str) -> bool",
        "returns whether s reads the same backwards, ignoring case and every character "
        "that is not a letter or digit",
        "def is_palindrome(s):\n"
        "    t = [c.lower() for c in s if c.isalnum()]\n"
        "    return t == t[::-1]\n",
        _palindrome_args,
    ),
    Template(
        "fizzbuzz",
        "fizzbuzz(n: int) -> list[str]",
        "returns the list for 1..n where multiples of 3 are 'Fizz', of 5 'Buzz', of both "
        "'FizzBuzz', and other numbers their decimal string",
        "def fizzbuzz(n):\n"
        "    out = []\n"
        "    for i in range(1, n + 1):\n"
        "        s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n"
        "        out.append(s or str(i))\n"
        "    return out\n",
        lambda rng: [rng.randint(0, 40)],
    ),
    Template(
        "second_largest",
        "second_largest(xs: list[int]) -> int | None",
        "returns the second largest distinct value in xs, or None if there is none",
        "def second_largest(xs):\n"
        "    vals = sorted(set(xs))\n"
        "    return vals[-2] if len(vals) >= 2 else None\n",
        lambda rng: [[rng.randint(-5, 9) for _ in range(rng.randint(0, 7))]],
    ),
    Template(
        "run_length",
        "run_length(s: str) -> str",
        "returns the run-length encoding of s: each maximal run of one character written as "
        "the character followed by the run's length, e.g. 'aaab' -> 'a3b1'",
        "def run_length(s):\n"
        "    out = []\n"
        "    i = 0\n"
        "    while i < len(s):\n"
        "        j = i\n"
        "        while j < len(s) and s[j] == s[i]:\n"
        "            j += 1\n"
        "        out.append(s[i] + str(j - i))\n"
        "        i = j\n"
        "    return ''.join(out)\n",
        lambda rng: [
            "".join(rng.choice("aab") * rng.randint(1, 12) for _ in range(rng.randint(0, 4)))
        ],
    ),
    Template(
        "gcd_list",
        "gcd_list(xs: list[int]) -> int",
        "returns the greatest common divisor of the positive integers in the non-empty list xs",
        "def gcd_list(xs):\n"
        "    g = 0\n"
        "    for x in xs:\n"
        "        while x:\n"
        "            g, x = x, g % x\n"
        "    return g\n",
        lambda rng: [
            [rng.choice([2, 3, 5, 7]) * rng.randint(1, 30) for _ in range(rng.randint(1, 5))]
        ],
    ),
    Template(
        "merge_intervals",
        "merge_intervals(intervals: list[list[int]]) -> list[list[int]]",
        "merges overlapping or touching closed intervals [a, b] and returns them sorted by "
        "start, e.g. [[1, 3], [2, 6], [8, 9]] -> [[1, 6], [8, 9]]",
        "def merge_intervals(intervals):\n"
        "    out = []\n"
        "    for a, b in sorted(intervals):\n"
        "        if out and a <= out[-1][1]:\n"
        "            out[-1][1] = max(out[-1][1], b)\n"
        "        else:\n"
        "            out.append([a, b])\n"
        "    return out\n",
        _intervals_args,
    ),
    Template(
        "caesar",
        "caesar(s: str, k: int) -> str",
        "shifts every ASCII letter of s forward by k places in the alphabet (wrapping, "
        "keeping case) and leaves every other character unchanged",
        "def caesar(s, k):\n"
        "    out = []\n"
        "    for c in s:\n"
        "        if 'a' <= c <= 'z':\n"
        "            c = chr((ord(c) - 97 + k) % 26 + 97)\n"
        "        elif 'A' <= c <= 'Z':\n"
        "            c = chr((ord(c) - 65 + k) % 26 + 65)\n"
        "        out.append(c)\n"
        "    return ''.join(out)\n",
        lambda rng: [
            "".join(rng.choice("abyzAYZ !9") for _ in range(rng.randint(0, 12))),
            rng.randint(-30, 30),
        ],
    ),
    Template(
        "max_subarray",
        "max_subarray(xs: list[int]) -> int",
        "returns the largest sum of a non-empty contiguous slice of the non-empty list xs",
        "def max_subarray(xs):\n"
        "    best = cur = xs[0]\n"
        "    for x in xs[1:]:\n"
        "        cur = max(x, cur + x)\n"
        "        best = max(best, cur)\n"
        "    return best\n",
        lambda rng: [[rng.randint(-9, 9) for _ in range(rng.randint(1, 9))]],
    ),
    Template(
        "count_primes",
        "count_primes(n: int) -> int",
        "returns how many prime numbers are smaller than n",
        "def count_primes(n):\n"
        "    return sum(\n"
        "        1 for p in range(2, n) if all(p % d for d in range(2, int(p ** 0.5) + 1))\n"
        "    )\n",
        lambda rng: [rng.randint(0, 500)],
    ),
]

BY_FUNCTION = {t.function: t for t in TEMPLATES}


@functools.cache
def reference_function(function: str) -> Callable[..., Any]:
    """The template's reference solution, exec'd here: trusted code of ours."""
    namespace: dict[str, Any] = {}
    exec(BY_FUNCTION[function].source, namespace)
    return namespace[function]
