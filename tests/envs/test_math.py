"""The math env and verifier: exact equivalence, answer extraction, datasets, hostile input."""

from __future__ import annotations

import random

import pytest

from streamrl.envs import make_env
from streamrl.envs.math import KINDS, DatasetError, load_dataset
from streamrl.evaluation.audit import make_task, play
from streamrl.schema import Message
from streamrl.verifiers.answers import final_answers
from streamrl.verifiers.math import ParseError, equivalent, parse, score


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("1/2", "0.5"),
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac{3}{6}", "1/2"),
        ("2x+1", "1+2x"),
        ("10 + 2x", "2x + 10"),
        ("x^2 + 2x + 1", "(x+1)^2"),  # an expected answer not in simplest form: value only
        ("(x+1)^2", "(x+1)^2"),
        ("x = -x + 17", "17 - x"),
        ("2 * x + 3/4", "2x + 0.75"),
        ("2x/3 + 1", "\\frac{2}{3}x + 1"),
        ("xy - 1", "x*y - 1"),
        ("x = -12", "-12"),
        ("1,234", "1234"),
        ("\\$12.75", "51/4"),
        ("Paris", "\\text{Paris}"),
        ("17 + 8 = 25", "25"),  # a true final equation answers its right side
        ("-3/4", "-0.75"),
        ("\\frac{3}{4}", "0.75"),
        ("+12", "12"),
        ("the sum = 25", "25"),
    ],
)
def test_equivalent_forms(answer: str, expected: str) -> None:
    assert equivalent(answer, expected)


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        ("0.33", "1/3"),  # decimals are exact
        ("1 2", "12"),  # juxtaposed numbers are not a number
        ("2x+2", "2x+1"),
        ("x", "y"),
        ("", "0"),
        ("1, 2", "12"),
        ("London", "Paris"),
        ("49 + 5 = 54.5", "54.5"),  # a false equation answers nothing
        ("17 + 8 = 24", "24"),
        ("17 + 8", "25"),  # the question's own arithmetic is not its answer (a GRPO run found it)
        ("17 + 8 = 17 + 8", "25"),
        ("(3 + 4) * 2 - 1", "13"),
        ("2 * 3 \\times 4", "24"),
        ("1 = 2 = 3", "3"),
        ("x <= 3", "3"),
        # the question of a "simplify" task restated (its value is right; its form is not)
        ("3(x + 2) - x + 4", "2x + 10"),
        ("(x+1)^2", "x^2 + 2x + 1"),
        ("x + x + 10", "2x + 10"),
        ("2x + 4 + 6", "2x + 10"),
        ("x x + 1", "x^2 + 1"),
    ],
)
def test_different_answers(answer: str, expected: str) -> None:
    assert not equivalent(answer, expected)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "9^9^9^9",
        "(" * 100 + "1" + ")" * 100,
        "x/(x-1)",
        "1/0",
    ],
)
def test_hostile_or_unsupported_input_is_a_parse_error(text: str) -> None:
    with pytest.raises(ParseError):
        parse(text)


def test_final_answer_precedence() -> None:
    assert final_answers("work\n\\boxed{\\frac{1}{2}}\nmore text") == ["\\frac{1}{2}"]
    assert final_answers("<answer>7</answer>") == ["7"]
    assert final_answers("thinking 3\nAnswer: 42\n") == ["42"]
    assert final_answers("so 2 + 2\nThe answer is 4.") == ["4"]
    assert final_answers("\\boxed{3") == ["\\boxed{3"]  # unclosed: not markup, just a last line
    assert final_answers("   \n") == []


def test_score_requires_every_final_answer_to_agree() -> None:
    assert score("The answer is \\boxed{0.5}.", "1/2").reward == 1.0
    assert score("Answer: 1/2", "0.5").reward == 1.0
    assert score("\\boxed{0.5} or maybe \\boxed{0.25}", "1/2").reward == 0.0
    assert score("\\boxed{1/2} \\boxed{0.5}", "1/2").reward == 1.0
    assert score("I think it is 3 or 4", "4").reward == 0.0
    assert score("", "4").reward == 0.0


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_generated_kinds_reference_scores_one_and_wrong_zero(kind: str) -> None:
    env = make_env("math", kinds=[kind])
    for index in range(5):
        task = make_task(env, seed=3, index=index)
        assert parse(task.data["answer"]) is not None  # generated answers are exact math
        ref = play(env, task, env.reference)
        assert env.verify(task, ref, env.decode_state(ref.state)).reward == env.max_reward
        wrong = play(env, task, env.wrong)
        assert env.verify(task, wrong, env.decode_state(wrong.state)).reward == 0.0


def test_generator_is_deterministic_per_seed() -> None:
    env = make_env("math")
    a = env.generate(random.Random(5), 2)
    b = env.generate(random.Random(5), 2)
    assert a == b


def test_dataset_rows(tmp_path) -> None:
    path = tmp_path / "qa.jsonl"
    path.write_text(
        '{"question": "What is 6*7?", "answer": 42}\n\n{"question": "Half?", "answer": "1/2"}\n'
    )
    env = make_env("math", dataset=str(path))
    task = make_task(env, seed=0, index=1)
    assert task.data["answer"] == "1/2" and "Half?" in task.input[0].content
    trajectory = play(env, task, lambda t, i, s: Message(role="assistant", content="Answer: 0.5"))
    assert env.verify(task, trajectory, env.decode_state(trajectory.state)).reward == 1.0
    assert make_task(env, seed=0, index=2).data["answer"] == "42"  # rows cycle


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        ('["a", "b"]', "JSON object"),
        ('{"question": "", "answer": "1"}', "'question'"),
        ('{"question": "Q?"}', "'answer'"),
    ],
)
def test_bad_dataset_row_names_its_line(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "ok?", "answer": "1"}\n' + line + "\n")
    with pytest.raises(DatasetError, match=rf"bad.jsonl:2: .*{message}"):
        load_dataset(path)
