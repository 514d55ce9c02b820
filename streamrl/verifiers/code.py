"""Unit-testing a model's Python function in the sandbox, so that it cannot fake passing.

The harness runs in the sandbox next to ``solution.py``: it loads the solution, calls the
function on each hidden test's arguments and reports only the **outputs** (as JSON), one line
per test tagged with a per-run random nonce. Whether a test passed is decided here, outside
the sandbox, by comparing canonical JSON with the expected value, which never enters the
sandbox. So printing "PASS", exiting early with code 0, or rewriting the harness's reporting
cannot earn credit: the only way to report a right output is to compute it. The nonce just
keeps the solution's own prints from being parsed as results by accident.

Which code runs (``solution_code``): exactly one solution is taken from a message. Code blocks
are Markdown fences that open and close at the start of a line (up to three spaces of indent,
as in CommonMark; a fence in mid-line is text); with no block, the whole message is the code.
Every statement in every block that binds the function's name (``def``, ``class``, an
assignment, an import) is a definition; definitions that differ only in layout count as one.
A message holding **several different definitions** of the function scores 0 without being run
(a message hedging between a wrong and a right solution must not get the right one's credit,
which "run the last block" used to give), and so does a message over
``MAX_CODE_ANSWER_CHARS`` characters. Otherwise the last block defining the function runs (or,
if none does, the last ```python block, else the last block, else the whole text).

Reward: the fraction of hidden tests whose output matches (``pass_rate``); ``all_passed`` is
1.0 when every test does. A solution that does not load or lacks the function scores 0. If
the sandbox itself breaks, ``SandboxError`` propagates: a verifier failure, never a 0.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from typing import Any

import msgspec

from streamrl.defaults import MAX_CODE_ANSWER_CHARS
from streamrl.verifiers.sandbox import run_python

_FENCE = re.compile(
    r"^ {0,3}```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)^ {0,3}```", re.DOTALL | re.MULTILINE
)

_HARNESS = r"""
import copy, json, os, signal, sys

NONCE, FUNCTION, PER_TEST_S = sys.argv[1], sys.argv[2], float(sys.argv[3])
channel = os.dup(1)
quiet = os.open(os.devnull, os.O_WRONLY)
os.dup2(quiet, 1)  # the solution's prints go nowhere
sys.stdout = open(1, "w", closefd=False)


def emit(obj):
    os.write(channel, (NONCE + " " + json.dumps(obj) + "\n").encode())


def on_alarm(signum, frame):
    raise TimeoutError(f"test took longer than {PER_TEST_S}s")


with open("tests.json") as f:
    tests = json.load(f)
try:
    namespace = {"__name__": "solution"}
    with open("solution.py") as f:
        exec(compile(f.read(), "solution.py", "exec"), namespace)
    fn = namespace[FUNCTION]
    if not callable(fn):
        raise TypeError(f"{FUNCTION} is not callable")
except BaseException as e:
    emit({"load_error": f"{type(e).__name__}: {e}"[:300]})
    os._exit(0)
emit({"loaded": True})
signal.signal(signal.SIGALRM, on_alarm)
for i, args in enumerate(tests):
    try:
        signal.setitimer(signal.ITIMER_REAL, PER_TEST_S)
        out = fn(*copy.deepcopy(args))
        signal.setitimer(signal.ITIMER_REAL, 0)
        emit({"i": i, "out": out})
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        emit({"i": i, "error": f"{type(e).__name__}: {e}"[:300]})
"""


class TestReport(msgspec.Struct, kw_only=True):
    total: int
    passed: int
    loaded: bool
    first_failure: str = ""
    limit_hit: str | None = None

    @property
    def pass_rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


def extract_code(text: str) -> str:
    """The last ```python block, else the last fenced block, else the whole text."""
    blocks = _FENCE.findall(text)
    for lang, body in reversed(blocks):
        if lang.lower() in ("python", "py", "python3"):
            return body
    return blocks[-1][1] if blocks else text


def definitions(code: str, function: str) -> set[str]:
    """Each distinct statement in ``code`` that binds ``function``, normalised (``ast.dump``,
    so layout and comments do not matter). Code that does not parse: its ``def`` lines."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        header = re.compile(rf"^[ \t]*(?:async[ \t]+)?def[ \t]+{re.escape(function)}\b", re.M)
        return {code} if header.search(code) else set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            binds = node.name == function
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            binds = any((a.asname or a.name.split(".")[0]) == function for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.For, ast.With)):
            binds = any(
                isinstance(n, ast.Name) and n.id == function and isinstance(n.ctx, ast.Store)
                for part in ast.iter_child_nodes(node)
                if not isinstance(part, ast.stmt)
                for n in ast.walk(part)
            )
        else:
            binds = isinstance(node, ast.NamedExpr) and node.target.id == function
        if binds:
            found.add(ast.dump(node))
    return found


def solution_code(
    text: str, function: str, max_chars: int = MAX_CODE_ANSWER_CHARS
) -> tuple[str, str]:
    """(code to run, "") or ("", why the answer is rejected): the rule in the module
    docstring."""
    if len(text) > max_chars:
        return "", f"answer of {len(text)} characters; at most {max_chars} are run"
    blocks = [body for _, body in _FENCE.findall(text)] or [text]
    seen: set[str] = set()
    chosen = ""
    for body in blocks:
        found = definitions(body, function)
        if found:
            seen |= found
            chosen = body
    if len(seen) > 1:
        return "", f"{len(seen)} different definitions of {function}; answer with one"
    return (chosen or extract_code(text)), ""


def _canonical(value: Any) -> str:
    """JSON text with sorted keys: ``True`` and ``1`` differ, tuples equal lists."""
    return json.dumps(value, sort_keys=True)


def run_tests(
    solution: str,
    function: str,
    tests: list[dict[str, Any]],
    *,
    timeout_s: float = 10.0,
    per_test_s: float = 2.0,
    memory_mb: int = 512,
) -> TestReport:
    """Run ``function`` from ``solution`` on each test's ``args``; compare with ``expected``."""
    nonce = secrets.token_hex(16)
    result = run_python(
        _HARNESS,
        files={"solution.py": solution, "tests.json": json.dumps([t["args"] for t in tests])},
        args=[nonce, function, str(per_test_s)],
        timeout_s=timeout_s,
        cpu_s=timeout_s,
        memory_mb=memory_mb,
        max_procs=4,
        max_file_mb=1,
        max_output_bytes=1 << 20,
    )
    outputs: dict[int, dict[str, Any]] = {}
    loaded, failure = False, ""
    for line in result.stdout.splitlines():
        tag, _, payload = line.partition(" ")
        if tag != nonce:
            continue
        try:
            msg = json.loads(payload)
        except json.JSONDecodeError:
            continue
        if "loaded" in msg:
            loaded = True
        elif "load_error" in msg and not failure:
            failure = f"solution did not load: {msg['load_error']}"
        elif isinstance(msg.get("i"), int):
            outputs.setdefault(msg["i"], msg)  # first report for a test wins
    passed = 0
    for i, test in enumerate(tests):
        got = outputs.get(i)
        if (
            got is not None
            and "out" in got
            and _canonical(got["out"]) == _canonical(test["expected"])
        ):
            passed += 1
        elif not failure:
            if got is None:
                failure = f"test {i}: no result ({result.limit_hit or 'exited early'})"
            elif "error" in got:
                failure = f"test {i}: {got['error']}"
            else:
                failure = f"test {i}: got {_canonical(got['out'])[:80]}"
    if not loaded:
        passed = 0
    return TestReport(
        total=len(tests),
        passed=passed,
        loaded=loaded,
        first_failure=failure,
        limit_hit=result.limit_hit,
    )
