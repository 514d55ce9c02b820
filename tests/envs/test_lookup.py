"""``lookup``: two tool calls whose outputs matter, scored on the final state."""

from __future__ import annotations

import json
import random

from streamrl.envs import make_env
from streamrl.envs.lookup import HELDOUT_NAMES, TRAIN_NAMES
from streamrl.schema import FunctionCall, FunctionCallOutput, Message


def _code(task) -> int:
    return int(task.data["directory"][task.data["target"]])


def test_reference_looks_up_then_submits_and_submitting_ends_the_episode(episode):
    env = make_env("lookup")
    task = episode.make_task(env, seed=3)
    trajectory, state = episode.play(env, task, env.reference)
    played = trajectory.items[len(task.input) :]
    assert [type(i) for i in played] == [FunctionCall, FunctionCallOutput] * 2  # no third turn
    assert json.loads(played[1].output) == {"name": task.data["target"], "code": _code(task)}
    verdict = env.verify(task, trajectory, state)
    assert verdict.reward == 1.0 and verdict.components == {"lookup": 1.0, "submit": 1.0}


def test_the_code_must_come_from_looking_up_the_right_person(episode):
    env = make_env("lookup", people=3)
    task = episode.make_task(env, seed=5)
    target, code = task.data["target"], _code(task)
    other = next(n for n in task.data["directory"] if n != target)
    other_code = task.data["directory"][other]
    cases = {
        "wrong": (env.wrong, 0.0),
        "guessed without a lookup": (episode.calls([("submit", {"code": code})]), 0.0),
        "another person's code": (
            episode.calls([("lookup", {"name": other}), ("submit", {"code": other_code})]),
            0.0,
        ),
        "lower-case name": (
            episode.calls([("lookup", {"name": target.lower()}), ("submit", {"code": code})]),
            1.0,
        ),
        "answered in words": (episode.say(str(code)), 0.0),
    }
    for label, (policy, want) in cases.items():
        assert episode.score(env, task, policy).reward == want, label


def test_a_models_broken_calls_come_back_as_error_outputs(episode):
    env = make_env("lookup")
    task = episode.make_task(env, seed=1)
    state = env.reset(task)
    for name, args, says in [
        ("lookup", '{"name": "Nobody"}', "no person named 'Nobody'"),
        ("lookup", '{"name": ', "not valid JSON"),
        ("submit", '{"code": "12ab"}', "invalid arguments for submit"),
        # seen from SmolLM2 through vLLM: a 20-digit code, which no state could store
        ("submit", '{"code": 57382044482233486083}', "code 573820444822... is out of range"),
        ("search", "{}", "unknown tool 'search'"),
    ]:
        result = env.call_tool(state, FunctionCall(call_id="c", name=name, arguments=args))
        assert result.output.startswith("error:") and says in result.output, result.output
        assert result.state == state and not result.done


def test_held_out_prompts_name_people_no_training_prompt_names():
    assert not set(TRAIN_NAMES) & set(HELDOUT_NAMES)
    seen = {}
    for split in ("train", "heldout"):
        env = make_env("lookup", split=split)
        people = set()
        for i in range(200):
            prompt = env.generate(random.Random(f"{split}:{i}"), i)
            people |= set(prompt.data["directory"])
            question = prompt.input[-1]
            assert isinstance(question, Message) and prompt.data["target"] in question.content
        seen[split] = people
    assert seen["train"] <= set(TRAIN_NAMES) and seen["heldout"] <= set(HELDOUT_NAMES)
    assert not seen["train"] & seen["heldout"]
    # the worked example at the top of every prompt names someone in neither split
    example = make_env("lookup").generate(random.Random(0), 0).input[0].content
    assert not any(n in example for n in TRAIN_NAMES + HELDOUT_NAMES)


def test_held_out_prompts_are_tasks_not_just_questions():
    """48 names, but the code is the task: more held-out prompts than names exist, while the
    kayles rule (same words, same prompt) still holds for environments that do not say so."""
    from streamrl.evaluation.heldout import heldout_prompts

    held = heldout_prompts(make_env("lookup", split="heldout"), 120, seed=0, train_prompts=300)
    assert len(held.tasks) == 120 and len({t.data["target"] for t in held.tasks}) <= 48
    codes = {(t.data["target"], t.data["directory"][t.data["target"]]) for t in held.tasks}
    assert len(codes) == 120
