"""``code``: write a small Python function; hidden unit tests decide.

Single turn: the prompt states the function and shows one example; the model answers with
the function (in a ```python block, or plain). The verifier runs the hidden tests in the
sandbox (``verifiers/code.py``).

Reward = fraction of hidden tests passed, in [0, 1]; 1.0 exactly when every test passes. The
answer must hold exactly one solution: a message with several different definitions of the
function, or over ``MAX_CODE_ANSWER_CHARS`` characters, scores 0 without being run. Which code
runs, and how the harness keeps a solution from faking a pass, is in ``verifiers/code.py``.

Options: ``tests`` (hidden tests per task, default 8), ``templates`` (function names to draw
from, default all 12 in ``_code_tasks.py``), ``timeout_s`` (sandbox wall clock per episode,
default 10), ``per_test_s`` (per hidden test, default 2).
"""

from __future__ import annotations

import json
import random
import re
from typing import Annotated

import msgspec

from streamrl.envs._code_tasks import BY_FUNCTION, TEMPLATES, reference_function
from streamrl.envs.base import Environment, Prompt, Verdict, last_assistant_text, user
from streamrl.schema import Item, Message, Task, Trajectory
from streamrl.verifiers.code import run_tests, solution_code


class CodeState(msgspec.Struct):
    """Nothing changes during the episode; the answer is the last assistant message."""

    function: str = ""


class CodeEnv(Environment[CodeState]):
    name = "code"
    version = "1"
    verifier_name = "code-unit-tests"
    verifier_version = "2"
    State = CodeState

    class Options(msgspec.Struct, kw_only=True):
        templates: list[str] | None = None  # function templates to draw from; default all
        tests: Annotated[int, msgspec.Meta(ge=1, le=100)] = 8
        timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0
        per_test_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0

    tools = []

    def generate(self, rng: random.Random, index: int) -> Prompt:
        names = self.options.get("templates") or [t.function for t in TEMPLATES]
        template = BY_FUNCTION[rng.choice(sorted(names))]
        ref = reference_function(template.function)
        n = int(self.options.get("tests", 8))
        seen: set[str] = set()
        tests = []
        for _ in range(n * 20):
            if len(tests) == n:
                break
            args = template.args(rng)
            key = json.dumps(args)
            if key in seen:
                continue
            seen.add(key)
            # the JSON round trip makes expected values what the harness can report
            expected = json.loads(json.dumps(ref(*json.loads(key))))
            tests.append({"args": args, "expected": expected})
        example = tests[0]
        call = f"{template.function}({', '.join(map(repr, example['args']))})"
        text = (
            f"Write a Python function `{template.signature}` that {template.statement}.\n"
            f"Example: {call} == {example['expected']!r}\n"
            "It will be checked against hidden unit tests. Use only the standard library. "
            "Answer with the complete function in a ```python code block."
        )
        return Prompt([user(text)], {"function": template.function, "tests": tests})

    def reset(self, task: Task) -> CodeState:
        return CodeState(function=str(task.data["function"]))

    def verify(self, task: Task, trajectory: Trajectory, state: CodeState) -> Verdict:
        answer = last_assistant_text(trajectory.items)
        code, rejected = solution_code(answer, task.data["function"])
        if rejected:
            total = len(task.data["tests"])
            return Verdict(
                reward=0.0,
                components={"pass_rate": 0.0, "all_passed": 0.0, "loaded": 0.0},
                details={"passed": f"0/{total}", "first_failure": rejected, "limit_hit": ""},
            )
        report = run_tests(
            code,
            task.data["function"],
            task.data["tests"],
            timeout_s=float(self.options.get("timeout_s", 10.0)),
            per_test_s=float(self.options.get("per_test_s", 2.0)),
        )
        return Verdict(
            reward=report.pass_rate,
            components={
                "pass_rate": report.pass_rate,
                "all_passed": float(report.passed == report.total),
                "loaded": float(report.loaded),
            },
            details={
                "passed": f"{report.passed}/{report.total}",
                "first_failure": report.first_failure[:200],
                "limit_hit": report.limit_hit or "",
            },
        )

    def reference(self, task: Task, items: list[Item], state: CodeState) -> Item:
        source = BY_FUNCTION[task.data["function"]].source
        return Message(role="assistant", content=f"```python\n{source}```")

    def wrong(self, task: Task, items: list[Item], state: CodeState) -> Item:
        """A solution fitted to the prompt's example: the reference's output on the example's
        arguments, a slightly different value of the same type on every other input. So it
        fails every hidden test but the example (reward 1/n), and all n of them if n is 1."""
        function, tests = task.data["function"], task.data["tests"]
        draft = re.sub(rf"\b{function}\b", f"_{function}_draft", BY_FUNCTION[function].source)
        example = tests[0]["args"] if len(tests) > 1 else None
        source = (
            f"{draft}\n\n"
            f"def {function}(*args):\n"
            f"    out = _{function}_draft(*args)\n"
            f"    if list(args) == {example!r}:\n"
            "        return out\n"
            "    if isinstance(out, bool):\n"
            "        return not out\n"
            "    if isinstance(out, (int, float)):\n"
            "        return out + 1\n"
            "    if isinstance(out, str):\n"
            "        return out + ' '\n"
            "    if isinstance(out, list):\n"
            "        return out[:-1] if out else [None]\n"
            "    return 0 if out is None else None\n"
        )
        return Message(role="assistant", content=f"```python\n{source}```")
