"""An episode driver for environment tests: the same loop the rollout worker runs, in-process.

A policy is ``(task, items, state) -> Item``, like ``Environment.reference``. The state is
encoded and decoded after every step, as the worker's session checkpoint does, so an
environment whose state does not round-trip fails here.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from streamrl.envs.base import Environment, Verdict, user
from streamrl.schema import FunctionCall, FunctionCallOutput, Item, Message, Task, Trajectory

Policy = Callable[[Task, list[Item], Any], Item]


def make_task(env: Environment, seed: int = 0, index: int = 0) -> Task:
    prompt = env.generate(random.Random(seed), index)
    return Task(
        task_id=f"p{seed}-{index}:0",
        prompt_id=f"p{seed}-{index}",
        k=0,
        group_size=1,
        env=env.name,
        input=prompt.input,
        data=prompt.data,
        seed=seed,
    )


def play(env: Environment, task: Task, policy: Policy, max_turns: int = 64):
    """Run one episode; returns (trajectory, final state)."""
    state = env.reset(task)
    items: list[Item] = list(task.input)
    for _ in range(max_turns):
        item = policy(task, items, state)
        items.append(item)
        if isinstance(item, FunctionCall):
            result = env.call_tool(state, item)
            state = result.state
            items.append(FunctionCallOutput(call_id=item.call_id, output=result.output))
            if result.done:
                break
        else:
            assert isinstance(item, Message) and item.role == "assistant"
            reply = env.reply(state, item.content)
            state = reply.state
            if reply.message is not None:
                items.append(user(reply.message))
            if reply.done:
                break
        blob = env.encode_state(state)
        state = env.decode_state(blob)
        assert env.encode_state(state) == blob
    trajectory = Trajectory(
        task_id=task.task_id,
        prompt_id=task.prompt_id,
        k=task.k,
        group_size=task.group_size,
        env=task.env,
        items=items,
        turns=[],
        status="completed",
        state=env.encode_state(state),
        data=task.data,
    )
    return trajectory, state


def say(*texts: str) -> Policy:
    """A policy that sends these assistant messages in order, then repeats the last."""
    queue = list(texts)

    def policy(task: Task, items: list[Item], state: Any) -> Item:
        text = queue.pop(0) if len(queue) > 1 else queue[0]
        return Message(role="assistant", content=text)

    return policy


def calls(moves: Iterable[tuple[str, dict]], then: str = "done") -> Policy:
    """A policy that makes these tool calls in order, then says ``then``."""
    queue = list(moves)

    def policy(task: Task, items: list[Item], state: Any) -> Item:
        if queue:
            name, args = queue.pop(0)
            return FunctionCall(call_id=f"c{len(items)}", name=name, arguments=json.dumps(args))
        return Message(role="assistant", content=then)

    return policy


def score(env: Environment, task: Task, policy: Policy) -> Verdict:
    trajectory, _ = play(env, task, policy)
    return env.verify(task, trajectory, env.decode_state(trajectory.state))


class _Helpers:
    make_task = staticmethod(make_task)
    play = staticmethod(play)
    say = staticmethod(say)
    calls = staticmethod(calls)
    score = staticmethod(score)


@pytest.fixture
def episode():
    """The helpers above, for tests: ``episode.make_task``, ``episode.play``, ..."""
    return _Helpers
