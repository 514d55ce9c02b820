"""The openenv environment against a real OpenEnv server (openenv-core's echo template, its own
process): the tool is the server's action schema, an action the server refuses as invalid is
the model's mistake shown to it, prompts can come from the server's reset, and a full server
is waited on instead of failing the episode."""

from __future__ import annotations

import asyncio
import random

import pytest

from streamrl.envs import EnvUnavailable, make_env
from streamrl.envs.openenv import OpenEnvEnv
from streamrl.schema import FunctionCall, Message, Task
from tests.support.openenv_server import free_port


@pytest.fixture
def server(openenv_server):
    return openenv_server  # one session at a time, as the template writes it


def _task(i: int = 0) -> Task:
    return Task(task_id=f"p:{i}", prompt_id="p", k=i, group_size=8, env="openenv",
                input=[Message(role="user", content="echo")])  # fmt: skip


async def _save(state: object) -> None:
    return None


async def _episode(env: OpenEnvEnv, task: Task, args: list[str]) -> list:
    state = await env.aready(task, env.reset(task), [], _save)
    outputs = []
    for n, a in enumerate(args):
        call = FunctionCall(call_id=f"c{n}", name="step", arguments=a)
        result = await env.acall_durably(task, state, call, [], _save)
        state = result.state
        outputs.append(result.output)
    env.reply(state, "done")
    await asyncio.sleep(0)
    return [outputs, state]


def test_the_tool_is_the_action_schema_and_bad_actions_are_the_models(server):
    env = make_env("openenv", base_url=server.url)
    (tool,) = env.tools_for(_task())
    assert tool.name == "step" and tool.parameters["required"] == ["message"]
    assert "metadata" not in tool.parameters["properties"]

    async def run():
        try:
            return await _episode(
                env, _task(), ['{"message": "hi"}', '{"msg": 1}', "{not json", '{"message": "yo"}']
            )
        finally:
            await env.aclose()

    (good, invalid, broken, second), state = asyncio.run(run())
    assert good == '{"echoed_message": "hi", "message_length": 2}'
    assert invalid.startswith("error: invalid action:") and "Field required" in invalid
    assert broken.startswith("error: arguments are not valid JSON")
    assert second == '{"echoed_message": "yo", "message_length": 2}'
    # the server applied the two valid steps only, and rewarded them
    assert state.server_state["step_count"] == 2 and state.rewards == [0.2, 0.2]


def test_a_full_server_is_waited_on_and_prompts_come_from_reset(server):
    env = make_env("openenv", base_url=server.url)

    async def run():
        try:
            return await asyncio.gather(
                *(_episode(env, _task(i), ['{"message": "abc"}']) for i in range(4))
            )
        finally:
            await env.aclose()

    for outputs, state in asyncio.run(run()):  # four episodes through a one-session server
        assert outputs == ['{"echoed_message": "abc", "message_length": 3}']
        assert state.server_state["step_count"] == 1
    prompt = env.generate(random.Random(0), 5)
    assert prompt.data == {"reset": {"seed": 5}}
    assert "Echo Env environment ready!" in prompt.input[0].content


def test_a_server_that_is_not_there_is_unavailable():
    env = make_env("openenv", base_url=f"http://127.0.0.1:{free_port()}", retries=0)
    with pytest.raises(EnvUnavailable, match=r"GET .*/schema failed"):
        env.tools_for(_task())
    with pytest.raises(EnvUnavailable, match="cannot connect"):
        asyncio.run(env.aopen(_task(), env.State()))
