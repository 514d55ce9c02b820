"""The judge verifier's parts that need no server: the config's checks (one message each), the
rubric filled from the task and the trajectory, the score read from an answer (out of range
and missing are no score), the version that moves with the rubric, and the judge as one of
the run's weighted reward functions. Calls to a real judge process:
tests/workers/test_judge_pipeline.py."""

from __future__ import annotations

import msgspec
import pytest

from streamrl.config import JudgeConfig, RunConfig
from streamrl.schema import FunctionCall, FunctionCallOutput, Message, Task, Trajectory
from streamrl.verifiers.judge import Judge, config_version, fill, parse_score, retry_after
from streamrl.verifiers.reward_functions import RewardFunctionError, RewardFunctions

BASE = {"base_url": "http://127.0.0.1:1/v1", "model": "m", "prompt": "Q: {prompt} A: {response}"}


def _cfg(**kw) -> JudgeConfig:
    return msgspec.convert({**BASE, **kw}, JudgeConfig)


def _sample(items: list, data: dict | None = None) -> tuple[Task, Trajectory]:
    inp = [Message(role="user", content="What is 2 + 2?")]
    task = Task(task_id="p:0", prompt_id="p", k=0, group_size=1, env="chat", input=inp,
                data=data or {})  # fmt: skip
    traj = Trajectory(task_id="p:0", prompt_id="p", k=0, group_size=1, env="chat",
                      items=[*inp, *items], n_input=1, turns=[], status="completed")  # fmt: skip
    return task, traj


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"verifier": "judge"}, r'verifier "judge" needs a \[judge\] table'),
        ({"judge": BASE}, 'used only with verifier = "judge"'),
        ({"verifier": "judge", "judge": {**BASE, "prompt": "{"}}, "bad score_pattern or prompt"),
        ({"verifier": "judge", "judge": {**BASE, "prompt": "{0}"}}, "fields are plain names"),
        ({"verifier": "judge", "judge": {**BASE, "score_pattern": r"\d"}}, "needs a group"),
        ({"verifier": "judge", "judge": {**BASE, "max_score": 0}}, "max_score"),
        ({"verifier": "judge", "judge": {**BASE, "min_score": 5, "max_score": 5}}, "below"),
        ({"verifier": "judge", "judge": {**BASE, "max_in_flight": 0}}, "max_in_flight"),
    ],
)
def test_config_mistakes_are_one_message(config, message):
    with pytest.raises(msgspec.ValidationError, match=message):
        msgspec.convert(config, RunConfig)


def test_the_rubric_is_filled_from_the_task_and_the_trajectory():
    calls = [
        FunctionCall(call_id="c", name="add", arguments='{"a": 2}'),
        FunctionCallOutput(call_id="c", output="4"),
        Message(role="assistant", content="It is 4."),
    ]
    task, traj = _sample(calls, {"answer": 4, "_trl_standard_prompt": True})
    text = fill("{prompt}|{response}|{answer}", task, traj)
    assert text == 'What is 2 + 2?|call add({"a": 2})\noutput: 4\nassistant: It is 4.|4'
    with pytest.raises(ValueError, match=r"\{reference\} is not a column of task p:0"):
        fill("{reference}", task, traj)
    with pytest.raises(ValueError, match="_trl_standard_prompt"):  # streamrl's marks stay out
        fill("{_trl_standard_prompt}", task, traj)


@pytest.mark.parametrize(
    ("raw", "score"),
    [
        ("Score: 7", 7.0),
        ("the answer is fine. score = 10", 10.0),
        ("SCORE:3.5/10", 3.5),
        ("Score: 11", None),  # out of range: no score, not a clipped one
        ("Score: -1", None),
        ("I would give it a seven", None),
        ("", None),
    ],
)
def test_the_score_is_read_from_the_answer_or_is_none(raw, score):
    assert parse_score(raw, _cfg()) == score


def test_the_version_moves_with_what_changes_the_answer_not_with_the_address():
    v = config_version(_cfg())
    assert config_version(_cfg(base_url="http://elsewhere:8000")) == v
    assert config_version(_cfg(prompt="Q: {prompt} Reply: {response}")) != v
    assert config_version(_cfg(model="bigger")) != v
    assert config_version(_cfg(version="2")).startswith("2-")


def test_the_judge_is_a_weighted_reward_function():
    with pytest.raises(RewardFunctionError, match="needs the run's"):
        RewardFunctions(["judge"])
    judge = Judge(_cfg())
    alone = RewardFunctions(["judge"], judge=judge)
    assert alone.verifier_id == ("judge", judge.version)
    mixed = RewardFunctions(["judge", "examples.trl_rewards:no_extra_words"], [0.7, 0.3], judge)
    other = RewardFunctions(
        ["judge", "examples.trl_rewards:no_extra_words"], [0.7, 0.3], Judge(_cfg(version="2"))
    )
    assert mixed.names == ["judge", "no_extra_words"]
    assert mixed.verifier_id[0] == "reward-functions"
    assert mixed.verifier_id != other.verifier_id  # a new judge version is a new version


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("2", 2.0),
        ("0.5", 0.5),
        ("-3", 0.0),  # a time passed already: no wait
        ("Wed, 25 Nov 2026 18:00:30 GMT", 30.0),  # an HTTP date, 30 s after `now`
        ("Wed, 25 Nov 2026 17:59:00 GMT", 0.0),
        ("soon", None),
        ("", None),
        (None, None),
    ],
)
def test_retry_after_is_read_as_seconds_or_an_http_date(header, seconds):
    now = 1795629600.0  # Wed, 25 Nov 2026 18:00:00 GMT
    assert retry_after(header, now=now) == seconds
