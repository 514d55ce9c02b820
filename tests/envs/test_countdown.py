"""The countdown env and verifier: the rules, partial credit, and solvable generated puzzles."""

from __future__ import annotations

import random

import pytest

from streamrl.envs import make_env
from streamrl.envs.countdown import make_puzzle
from streamrl.evaluation.audit import make_task, play
from streamrl.verifiers.countdown import VALID_CREDIT, RuleError, evaluate, score

NUMBERS = [25, 50, 75, 3]


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("25 + 50", 75),
        ("(75 - 25) * 3", 150),
        ("75 / 3 + 50", 75),
        ("3 - 25", -22),  # negative intermediate values are allowed
        ("(25 × 3) ÷ 75", 1),
        ("50 + 25 = 75", 75),
    ],
)
def test_rule_abiding_expressions(expression: str, value: int) -> None:
    assert evaluate(expression, NUMBERS, target=75) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("25 + 25", "used too often"),
        ("25 + 4", "not one of the numbers"),
        ("50 / 3", "exact division"),
        ("-25 + 50", "expected a number"),
        ("2550", "not one of the numbers"),
        ("25 50", "unexpected"),
        ("(25 + 50", "ends too early"),
        ("25 ** 3", "expected a number"),
        ("__import__('os')", "unexpected"),
        ("25 + 50 = 80", "is not '= 75'"),
    ],
)
def test_rule_violations(expression: str, why: str) -> None:
    with pytest.raises(RuleError, match=why):
        evaluate(expression, NUMBERS, target=75)


def test_a_number_given_twice_may_be_used_twice() -> None:
    assert evaluate("7 * 7", [7, 7, 2]) == 49
    with pytest.raises(RuleError):
        evaluate("7 * 7 * 7", [7, 7, 2])


def test_score_levels() -> None:
    assert score("<answer>(75 - 25) * 3</answer>", NUMBERS, 150).reward == 1.0
    assert score("<answer>75 + 25</answer>", NUMBERS, 150).reward == VALID_CREDIT
    assert score("<answer>75 * 2</answer>", NUMBERS, 150).reward == 0.0  # 2 is not given
    assert score("", NUMBERS, 150).reward == 0.0
    both = "<answer>75 + 25</answer> <answer>(75 - 25) * 3</answer>"
    assert score(both, NUMBERS, 150).reward == 0.0  # several answers: no credit


def test_generated_puzzles_are_solvable() -> None:
    rng = random.Random(11)
    for count in (3, 4, 5, 6):
        for _ in range(40):
            numbers, target, solution = make_puzzle(rng, count, 999)
            assert len(numbers) == count and target not in numbers and 10 <= target <= 999
            assert evaluate(solution, numbers) == target


def test_reference_scores_max_and_wrong_scores_partial() -> None:
    env = make_env("countdown", count=5)
    for index in range(10):
        task = make_task(env, seed=1, index=index)
        ref = play(env, task, env.reference)
        assert env.verify(task, ref, env.decode_state(ref.state)).reward == env.max_reward
        wrong = play(env, task, env.wrong)
        assert env.verify(task, wrong, env.decode_state(wrong.state)).reward == VALID_CREDIT


def test_bad_count_is_rejected() -> None:
    with pytest.raises(ValueError, match="count=9: Expected `int` <= 6"):
        make_env("countdown", count=9)


def test_every_prompt_the_producer_derives_is_a_valid_puzzle() -> None:
    """Prompt 640 of seed 0 used to raise: its solution "a * b / c" was built as a * (b / c)
    but reads left to right, and the generator's own check refused the inexact division."""
    env = make_env("countdown")
    for i in range(1000):
        prompt = env.generate(random.Random(f"0:{i}"), i)
        assert evaluate(prompt.data["solution"], prompt.data["numbers"]) == prompt.data["target"]
