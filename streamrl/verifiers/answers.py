"""Finding a model's final answer in free text, shared by the answer-checking verifiers.

Precedence: markup first (every ``\\boxed{...}`` and every ``<answer>...</answer>``), else every
line that starts with "Answer:" / "Final answer:", else the last non-empty line (with a leading
"the answer is" dropped). All candidates are returned, never just the last one: a verifier then
requires them to agree, so a response that lists many answers at once earns nothing.
"""

from __future__ import annotations

import re

_MAX_ANSWER_CHARS = 500  # a boxed answer longer than this is not looked for (bounds the scan)

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TAG = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_ANSWER_LINE = re.compile(r"^\s*(?:\*\*)?\s*(?:final\s+)?answer\s*(?:\*\*)?\s*[:=]\s*(.*)$", re.I)
_LEAD = re.compile(
    r"^\s*(?:so|thus|therefore|hence)?[,\s]*(?:the\s+)?(?:final\s+)?answer\s+is\s*:?\s*", re.I
)


def boxed(text: str) -> list[str]:
    """Contents of every well-formed ``\\boxed{...}``; an unclosed one is not an answer."""
    found = []
    for m in _BOXED.finditer(text):
        depth, i, stop = 1, m.end(), min(len(text), m.end() + _MAX_ANSWER_CHARS)
        while i < stop and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append(text[m.end() : i - 1])
    return found


def _clean(candidate: str) -> str:
    """Drop what wraps an answer but is not part of it: blanks, $...$, bold, a final period."""
    s = candidate.strip()
    for _ in range(2):
        s = s.strip().removeprefix("**").removesuffix("**").strip()
        if len(s) >= 2 and s[0] == s[-1] == "$":
            s = s.strip("$").strip()
        s = s.removesuffix(".").strip()
    return s


def final_answers(text: str) -> list[str]:
    """Every candidate final answer in ``text``, cleaned (see the module docstring)."""
    marked = boxed(text) + _TAG.findall(text)
    if marked:
        return [_clean(c) for c in marked]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    answer_lines = [m.group(1) for ln in lines if (m := _ANSWER_LINE.match(ln))]
    if answer_lines:
        return [_clean(c) for c in answer_lines]
    if not lines:
        return []
    return [_clean(_LEAD.sub("", lines[-1], count=1))]
