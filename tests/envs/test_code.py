"""The ``code`` environment: reference solutions pass, wrong and cheating ones do not."""

from __future__ import annotations

import msgspec
import pytest

from streamrl.envs._code_tasks import TEMPLATES
from streamrl.envs.code import CodeEnv, CodeState
from streamrl.verifiers.code import definitions, extract_code, solution_code


def _task(episode, function="digit_sum", seed=0):
    env = CodeEnv(templates=[function], timeout_s=3.0, per_test_s=0.3)
    return env, episode.make_task(env, seed=seed)


def _answer(code: str) -> str:
    return f"Here you go:\n```python\n{code}\n```\n"


def test_at_least_eight_templates_with_distinct_tests(episode):
    assert len(TEMPLATES) >= 8
    _, task = _task(episode, "fizzbuzz")
    args = [t["args"] for t in task.data["tests"]]
    assert len(args) == 8 and len({str(a) for a in args}) == 8


@pytest.mark.parametrize("function", [t.function for t in TEMPLATES])
def test_reference_solution_scores_one(episode, function):
    env, task = _task(episode, function, seed=7)
    verdict = episode.score(env, task, env.reference)
    assert verdict.reward == 1.0, verdict.details
    assert verdict.components["all_passed"] == 1.0


def test_generator_is_seeded():
    env = CodeEnv()
    import random

    a = env.generate(random.Random(3), 0)
    b = env.generate(random.Random(3), 0)
    assert a == b


def test_wrong_solution_scores_zero_and_partial_scores_between(episode):
    env, task = _task(episode, "digit_sum")
    wrong = episode.score(env, task, episode.say(_answer("def digit_sum(n):\n    return -1")))
    assert wrong.reward == 0.0 and wrong.components["loaded"] == 1.0
    # right only for one-digit numbers: some hidden tests pass, not all
    partial_src = "def digit_sum(n):\n    return n if n < 10 else 0"
    task.data["tests"].append({"args": [7], "expected": 7})
    partial = episode.score(env, task, episode.say(_answer(partial_src)))
    assert 0.0 < partial.reward < 1.0


def test_bool_is_not_one(episode):
    """Canonical JSON comparison: True == 1 in Python, not here."""
    env, task = _task(episode, "count_vowels")
    task.data["tests"] = [{"args": ["a"], "expected": 1}]
    verdict = episode.score(
        env, task, episode.say(_answer("def count_vowels(s):\n    return True"))
    )
    assert verdict.reward == 0.0


CHEATS = {
    "prints PASS and exits 0": "print('PASS ' * 100)\nimport sys\nsys.exit(0)\n",
    "exits the interpreter at import": "import os\nos._exit(0)\n",
    "exits from inside the function": "def digit_sum(n):\n    raise SystemExit(0)\n",
    "forges result lines on every fd": """
import json, os, sys
nonce = sys.argv[1]
n = len(json.load(open("tests.json")))
lines = [nonce + ' {"loaded": true}'] + [
    nonce + " " + json.dumps({"i": i, "out": 0, "pass": True}) for i in range(n)
]
for fd in range(1, 20):
    try:
        os.write(fd, ("\\n".join(lines) + "\\nPASS\\n").encode())
    except OSError:
        pass
os._exit(0)
""",
    "patches the harness's json": """
import json
json.dumps = lambda *a, **k: '{"i": 0, "pass": true, "out": "PASS"}'
json.loads = lambda *a, **k: {"pass": True}
def digit_sum(n):
    return 0
""",
    "loops forever": "def digit_sum(n):\n    while True:\n        pass\n",
}


@pytest.mark.parametrize("name", list(CHEATS))
def test_cheats_get_no_credit(episode, name):
    env, task = _task(episode, "digit_sum")
    verdict = episode.score(env, task, episode.say(_answer(CHEATS[name])))
    assert verdict.reward == 0.0, (name, verdict)


def test_forging_the_channel_only_pays_with_the_right_outputs(episode):
    """The result channel is not secret from the solution; what it cannot fake is the
    expected values, which never enter the sandbox. Forging right outputs is solving."""
    env, task = _task(episode, "digit_sum")
    forge = (
        CHEATS["forges result lines on every fd"]
        .replace('"out": 0', '"out": sum(map(int, str(a[0])))')
        .replace("for i in range(n)", "for i, a in enumerate(json.load(open('tests.json')))")
    )
    assert episode.score(env, task, episode.say(_answer(forge))).reward == 1.0


def test_verify_is_deterministic(episode):
    env, task = _task(episode, "run_length", seed=11)
    half = "def run_length(s):\n    return '' if len(s) % 2 else s"
    trajectory, state = episode.play(env, task, episode.say(_answer(half)))
    first = env.verify(task, trajectory, state)
    assert env.verify(task, trajectory, state) == first


def test_state_round_trips():
    state = CodeState(function="caesar")
    blob = msgspec.msgpack.encode(state)
    assert msgspec.msgpack.decode(blob, type=CodeState) == state


def test_extract_code_prefers_the_last_python_block():
    text = "```\nnot this\n```\nthen\n```python\nfirst\n```\n```py\nsecond\n```\nbye"
    assert extract_code(text) == "second\n"
    assert extract_code("def f():\n    return 1") == "def f():\n    return 1"
    assert extract_code("```\nplain\n```") == "plain\n"


def test_registered():
    from streamrl.envs.registry import make_env

    assert type(make_env("code")) is CodeEnv


def _ref(function="digit_sum"):
    from streamrl.envs._code_tasks import BY_FUNCTION

    return BY_FUNCTION[function].source


def test_wrong_agent_passes_only_the_example(episode):
    env, task = _task(episode, "fizzbuzz")
    verdict = episode.score(env, task, env.wrong)
    assert verdict.reward == pytest.approx(1 / 8) and verdict.components["loaded"] == 1.0


BOTH = {
    # used to run only the last block: a hedge between a wrong and a right solution paid 1.0
    "two blocks": _answer("def digit_sum(n):\n    return 0") + "or maybe\n" + _answer(_ref()),
    "redefined in one block": _answer("def digit_sum(n):\n    return 0\n\n" + _ref()),
    "rebound by assignment": _answer(_ref() + "\ndigit_sum = lambda n: n % 9\n"),
    "broken draft then fix": "```python\ndef digit_sum(n)\n    return 0\n```\n" + _answer(_ref()),
}


@pytest.mark.parametrize("name", list(BOTH))
def test_several_different_definitions_score_zero(episode, name):
    env, task = _task(episode, "digit_sum")
    wrong = episode.score(env, task, env.wrong).reward
    verdict = episode.score(env, task, episode.say(BOTH[name]))
    assert verdict.reward == 0.0 <= wrong and "definitions" in verdict.details["first_failure"]


def test_one_definition_repeated_or_used_is_one_solution(episode):
    env, task = _task(episode, "digit_sum")
    again = "# same, reformatted\n" + _ref().replace("return ", "return  ")
    usage = "```python\nprint(digit_sum(123))\n```\n"
    text = _answer(_ref()) + "Again:\n" + _answer(again) + "Usage:\n" + usage
    assert episode.score(env, task, episode.say(text)).reward == 1.0


def test_a_fence_in_mid_line_is_not_a_code_block(episode):
    """A spray of boxed answers with the solution fenced on the same line used to run the
    solution; Markdown fences open at the start of a line, so this is one unparsable text."""
    env, task = _task(episode, "digit_sum")
    spray = " ".join(f"\\boxed{{{i}}}" for i in range(100)) + " ```python\n" + _ref() + "```"
    assert episode.score(env, task, episode.say(spray)).reward == 0.0


def test_an_answer_over_the_cap_is_not_run(episode):
    from streamrl.defaults import MAX_CODE_ANSWER_CHARS

    env, task = _task(episode, "digit_sum")
    text = "#" * MAX_CODE_ANSWER_CHARS + "\n" + _answer(_ref())
    verdict = episode.score(env, task, episode.say(text))
    assert verdict.reward == 0.0 and "characters" in verdict.details["first_failure"]


def test_solution_code_picks_the_block_that_defines_the_function():
    text = _answer(_ref()) + "```python\nprint(digit_sum(5))\n```\n"
    assert solution_code(text, "digit_sum") == (_ref() + "\n", "")
    assert definitions("def f(:", "f") == {"def f(:"} and definitions("x = 1", "f") == set()
