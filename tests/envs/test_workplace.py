"""The workplace env: every template's reference earns 1 and its mistake 0; side effects,
ungrounded guesses and malformed tool calls earn nothing."""

from __future__ import annotations

import json

import pytest

from streamrl.envs import make_env
from streamrl.envs._workplace_tasks import TEMPLATES
from streamrl.evaluation.audit import make_task, play
from streamrl.schema import FunctionCall, FunctionCallOutput, Message, Task

ENV = make_env("workplace")
N = len(TEMPLATES)


def task_for(template: str, seed: int = 0) -> Task:
    task = make_task(ENV, seed, list(TEMPLATES).index(template))
    assert task.data["template"] == template
    return task


def reward(task: Task, agent) -> float:
    trajectory = play(ENV, task, agent)
    assert trajectory.status == "completed"
    return ENV.verify(task, trajectory, ENV.decode_state(trajectory.state)).reward


def scripted(calls: list[tuple[str, dict]], final: str = "Done."):
    """An agent that makes ``calls`` in order, then answers ``final``."""

    def agent(task, items, state):
        done = sum(isinstance(i, FunctionCallOutput) for i in items)
        if done < len(calls):
            name, args = calls[done]
            return FunctionCall(call_id=f"c{done}", name=name, arguments=json.dumps(args))
        return Message(role="assistant", content=final)

    return agent


def test_at_least_eight_templates() -> None:
    assert N >= 8


@pytest.mark.parametrize("template", list(TEMPLATES))
@pytest.mark.parametrize("seed", [0, 7])
def test_reference_earns_one_and_mistake_zero(template: str, seed: int) -> None:
    task = task_for(template, seed)
    assert reward(task, ENV.reference) == ENV.max_reward
    assert reward(task, ENV.wrong) == 0.0


def test_emailing_an_extra_person_loses_the_reward() -> None:
    task = task_for("email_contact")
    plan = task.data["plan"]["calls"]
    send = dict(plan[-1][1])
    world = ENV.reset(task)
    bystander = next(c.email for c in world.contacts if c.email not in send["to"])
    extra = ("send_email", {**send, "to": [bystander]})
    assert reward(task, scripted([tuple(c) for c in plan])) == 1.0
    assert reward(task, scripted([*map(tuple, plan), extra])) == 0.0
    cc_too = ("send_email", {**send, "cc": [bystander]})
    assert reward(task, scripted([plan[0], cc_too])) == 0.0


def test_calendar_side_effects_and_recreating_instead_of_updating() -> None:
    task = task_for("move_event")
    world = ENV.reset(task)
    ((event_id, changes),) = task.data["expect"]["events"]["update"].items()
    event = next(e for e in world.events if e.id == event_id)
    recreate = [
        ("delete_event", {"event_id": event_id}),
        (
            "create_event",
            {
                "title": event.title,
                "day": changes["day"],
                "start": event.start,
                "end": event.end,
                "attendees": event.attendees,
            },
        ),
    ]
    assert reward(task, scripted(recreate)) == 1.0  # ids do not matter
    other = next(e for e in world.events if e.id != event_id)
    collateral = [*recreate, ("delete_event", {"event_id": other.id})]
    assert reward(task, scripted(collateral)) == 0.0


def test_answers_must_be_grounded_and_unique() -> None:
    task = task_for("manager_phone")
    plan = task.data["plan"]
    phone = task.data["expect"]["answer"]["value"]
    lookups = [tuple(c) for c in plan["calls"]]
    assert reward(task, scripted(lookups, f"It is {phone}")) == 1.0
    assert reward(task, scripted(lookups, f"It is {phone[3:].replace('-', ' ')}")) == 1.0
    assert reward(task, scripted([], f"It is {phone}")) == 0.0  # a guess, never looked up
    everyone = ", ".join(c.phone for c in ENV.reset(task).contacts)
    assert reward(task, scripted(lookups, everyone)) == 0.0


def test_tool_errors_come_back_to_the_model_and_change_nothing() -> None:
    task = task_for("email_contact")
    state = ENV.reset(task)
    cases = {
        '{"to": "x@acme.test", "subject": "s", "body": "b"}': "must be array",
        '{"to": ["nobody@elsewhere.test"], "subject": "s", "body": "b"}': "unknown address",
        '{"to": [], "subject": "s", "body": "b"}': "empty",
        '{"subject": "s", "body": "b"}': "missing required argument",
    }
    for arguments, message in cases.items():
        call = FunctionCall(call_id="c", name="send_email", arguments=arguments)
        result = ENV.call_tool(state, call)
        assert result.output.startswith("error:") and message in result.output
        assert result.state == state
    bad_time = FunctionCall(
        call_id="c",
        name="create_event",
        arguments=json.dumps({"title": "x", "day": "2025-03-04", "start": "10:00", "end": "09:00"}),
    )
    assert "end after it starts" in ENV.call_tool(state, bad_time).output


def test_search_marks_what_the_agent_has_seen() -> None:
    task = task_for("manager_phone")
    state = ENV.reset(task)
    who = state.contacts[3]
    result = ENV.call_tool(
        state,
        FunctionCall(
            call_id="c", name="search_contacts", arguments=json.dumps({"query": who.name})
        ),
    )
    assert who.id in result.state.seen and who.phone in result.output
    assert ENV.decode_state(ENV.encode_state(result.state)) == result.state
