"""One scripted episode, for the audit and the environment tests: a task from the generator,
an agent function as the policy, the rollout workers' own episode loop, the verifier's verdict."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

from streamrl.config import RolloutConfig
from streamrl.envs.base import Environment, Verdict
from streamrl.policy.base import Policy, PolicyRequest
from streamrl.schema import TASK, Item, ModelTurn, Task, Trajectory, encode
from streamrl.workers.episode import new_session, run_episode

Agent = Callable[[Task, list[Item], Any], Item]

DEFAULT_MAX_TURNS = 32


class _AgentPolicy(Policy):
    """An agent function as a policy backend, so the audit runs the workers' own loop."""

    name = "agent"

    def __init__(self, agent: Agent):
        self.agent = agent

    async def respond(self, request: PolicyRequest) -> ModelTurn:
        item = self.agent(request.task, request.items, request.state)
        return ModelTurn(index=request.turn, items=[item])


def play(
    env: Environment, task: Task, agent: Agent, max_turns: int = DEFAULT_MAX_TURNS
) -> Trajectory:
    """Run one episode through the rollout workers' episode loop (no Redis, no commits)."""
    config = RolloutConfig(max_turns=max_turns)
    session = new_session(env, task)
    return asyncio.run(run_episode(env, _AgentPolicy(agent), task, session, None, config))


def make_task(env: Environment, seed: int, index: int) -> Task:
    """Task ``index`` of the env's generator under ``seed``, after a msgpack round trip (so
    data that would not survive Redis fails here)."""
    prompt = env.generate(random.Random(f"{seed}:{index}"), index)
    prompt_id = f"{env.name}-{seed}-{index}"
    task = Task(
        task_id=f"{prompt_id}:0",
        prompt_id=prompt_id,
        k=0,
        group_size=1,
        env=env.name,
        input=list(prompt.input),
        data=dict(prompt.data),
        seed=seed,
    )
    return TASK.decode(encode(task))


def verify(env: Environment, task: Task, trajectory: Trajectory) -> Verdict:
    """Score as the verifier worker does: from the trajectory's encoded state only."""
    return env.verify(task, trajectory, env.decode_state(trajectory.state))
