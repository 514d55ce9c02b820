"""TRL-style reward functions score trajectories with the arguments TRL's GRPOTrainer gives
them: prompts and completions in the row's form, the dataset's columns, the sampled ids, the
trainer's state. None leaves a function out of the weighted sum, as TRL's nansum does; a
function that raises, or returns the wrong number of rewards, is a failure, never a 0."""

from __future__ import annotations

import pytest

from streamrl.config import RunConfig
from streamrl.schema import FunctionCall, FunctionCallOutput, Message, ModelTurn, Task, Trajectory
from streamrl.verifiers.reward_functions import (
    STANDARD_PROMPT,
    RewardFunctionError,
    RewardFunctions,
    Unscorable,
    trl_arguments,
)

M = "tests.support.trl_rewards"


def _sample(prompt: str, answer_items: list, data: dict, ids=(5, 6, 7), version=3):
    inp = [Message(role="user", content=prompt)]
    task = Task(task_id="p:0", prompt_id="p", k=0, group_size=1, env="chat", input=inp, data=data)
    turn = ModelTurn(index=0, items=answer_items, token_ids=list(ids), policy_version=version)
    traj = Trajectory(
        task_id="p:0",
        prompt_id="p",
        k=0,
        group_size=1,
        env="chat",
        items=[*inp, *answer_items],
        n_input=1,
        turns=[turn],
        status="completed",
        data=data,
    )
    return task, traj


def _say(text: str) -> list:
    return [Message(role="assistant", content=text)]


def test_the_docs_standard_form_example_gets_strings_and_its_column():
    data = {"ground_truth": "42", STANDARD_PROMPT: True}
    rf = RewardFunctions([f"{M}:reward_func"])
    right = rf.score(*_sample("Solve x.", _say("so \\boxed{42}"), data))
    wrong = rf.score(*_sample("Solve x.", _say("so \\boxed{41}"), data))
    assert (right.reward, wrong.reward) == (1.0, 0.0)
    assert right.info["reward_functions"] == {"reward_func": 1.0}
    kw = trl_arguments(*_sample("Solve x.", _say("a"), data))
    assert kw["prompts"] == ["Solve x."] and kw["completions"] == ["a"]
    assert kw["ground_truth"] == ["42"] and STANDARD_PROMPT not in kw


def test_the_docs_conversational_example_and_weights():
    good = _say("<think>2+2 is 4</think><answer>4</answer>")
    rf = RewardFunctions(
        [f"{M}:format_reward_func", "trl.rewards:think_format_reward"], weights=[1.0, 0.5]
    )
    v = rf.score(*_sample("What is 2+2?", good, {}))
    assert v.reward == 1.5
    assert v.components == {"format_reward_func": 1.0, "think_format_reward": 1.0}
    kw = trl_arguments(*_sample("What is 2+2?", good, {}))
    assert kw["prompts"] == [[{"role": "user", "content": "What is 2+2?"}]]
    assert kw["completions"] == [[{"role": "assistant", "content": good[0].content}]]
    bad = rf.score(*_sample("What is 2+2?", _say("4"), {}))
    assert bad.reward == 0.0


def test_tool_calls_are_tool_call_messages():
    items = [
        Message(role="assistant", content="let me look"),
        FunctionCall(call_id="c1", name="lookup", arguments='{"k": 1}'),
        FunctionCallOutput(call_id="c1", output="7"),
        Message(role="assistant", content="<answer>7</answer>"),
    ]
    (completion,) = trl_arguments(*_sample("q", items, {}))["completions"]
    assert completion == [
        {
            "role": "assistant",
            "content": "let me look",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "lookup", "arguments": '{"k": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "7"},
        {"role": "assistant", "content": "<answer>7</answer>"},
    ]


def test_none_is_left_out_of_the_sum_and_all_none_is_no_score():
    good = _say("<think>t</think><answer>5</answer>")
    rf = RewardFunctions([f"{M}:format_reward_func", f"{M}:answer_only_when_known"], [1.0, 2.0])
    unknown = rf.score(*_sample("q", good, {"answer": None}))
    assert unknown.reward == 1.0  # TRL: nansum over the functions that answered
    assert unknown.info["reward_functions"] == {
        "format_reward_func": 1.0,
        "answer_only_when_known": None,
    }
    assert rf.score(*_sample("q", good, {"answer": 5})).reward == 3.0
    with pytest.raises(Unscorable, match="every reward function returned None"):
        RewardFunctions([f"{M}:always_none"]).score(*_sample("q", good, {}))


def test_a_raise_propagates_and_is_never_a_zero():
    rf = RewardFunctions([f"{M}:format_reward_func", f"{M}:explodes"])
    with pytest.raises(RuntimeError, match="reward backend unavailable"):
        rf.score(*_sample("q", _say("x"), {"explode": True}))
    assert rf.score(*_sample("q", _say("x"), {"explode": False})).reward == 0.0


@pytest.mark.parametrize(
    ("func", "says"),
    [
        ("two_rewards", "returned 2 rewards for 1 completion"),
        ("not_a_number", "returned str, not a number"),
    ],
)
def test_answers_trl_would_refuse_are_failures(func, says):
    with pytest.raises(ValueError, match=says):
        RewardFunctions([f"{M}:{func}"]).score(*_sample("q", _say("x"), {}))


def test_trainer_arguments_and_async_functions():
    rf = RewardFunctions([f"{M}:trainer_only", f"{M}:async_length"])
    v = rf.score(*_sample("q", _say("abc"), {}, ids=(1, 2, 3, 4), version=7))
    assert v.info["reward_functions"] == {"trainer_only": 4.0, "async_length": 1.0}
    assert v.info["log_metric"] == {"seen_step": 7}


def test_bad_specs_and_weights_are_refused_where_they_enter():
    with pytest.raises(RewardFunctionError, match="expected module:function"):
        RewardFunctions(["nocolon"])
    with pytest.raises(RewardFunctionError, match="has no 'nope'"):
        RewardFunctions([f"{M}:nope"])
    with pytest.raises(RewardFunctionError, match="2 values for 1 reward functions"):
        RewardFunctions([f"{M}:reward_func"], [1.0, 2.0])
    with pytest.raises(ValueError, match="reward_weights has 1 values for 2"):
        RunConfig(verifier=[f"{M}:a", f"{M}:b"], reward_weights=[1.0])
    assert RunConfig(verifier=f"{M}:reward_func").reward_functions == [f"{M}:reward_func"]


def test_the_version_follows_the_functions_source():
    a = RewardFunctions([f"{M}:format_reward_func"]).verifier_id
    b = RewardFunctions([f"{M}:reward_func"]).verifier_id
    c = RewardFunctions([f"{M}:format_reward_func"], [2.0]).verifier_id
    assert a[0] == "reward-functions" and len({a[1], b[1], c[1]}) == 3
