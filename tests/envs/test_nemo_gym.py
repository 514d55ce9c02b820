"""The nemo-gym environment's parts: options, the row's tools, the cookie jar, the /verify
answer kept whole, and a server that cannot be reached. The whole pipeline against a running
resources server is in tests/workers/test_nemo_gym_pipeline.py."""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import pytest

from streamrl.envs import EnvUnavailable, make_env
from streamrl.envs.base import OptionError
from streamrl.envs.nemo_gym import merge_cookies, verdict_from_answer
from streamrl.responses import row_to_prompt
from streamrl.schema import FunctionCall, Task, Trajectory
from tests.support.nemo_gym import counter_row, free_port


def _task(row: dict) -> Task:
    items, data, pid = row_to_prompt(json.dumps(row))
    return Task(task_id=f"{pid}:0", prompt_id=pid, k=0, group_size=1, env="nemo-gym",
                input=items, data=data)  # fmt: skip


def test_base_url_is_required_and_checked():
    for bad in ({}, {"base_url": "localhost:8000"}, {"base_url": "ftp://x"}):
        with pytest.raises(OptionError, match="needs base_url"):
            make_env("nemo-gym", **bad)
    with pytest.raises(OptionError, match="no option 'base'"):
        make_env("nemo-gym", base="http://x")


def test_tools_come_from_the_row_and_other_tool_kinds_are_refused():
    env = make_env("nemo-gym", base_url="http://127.0.0.1:1")
    task = _task(counter_row("t", 0, [1]))
    assert [t.name for t in env.tools_for(task)] == [
        "increment_counter",
        "get_counter_value",
        "kv_set",
        "kv_get",
    ]
    row = counter_row("u", 0, [1])
    row["responses_create_params"]["tools"] = [{"type": "web_search"}]
    with pytest.raises(ValueError, match="only function tools"):
        env.reset(_task(row))
    # the request /verify gets: the row with its input rebuilt, the reference never sent
    body = env.row(task)
    assert body["responses_create_params"]["input"][1]["role"] == "user"
    assert body["expected_count"] == 1 and "reference_output" not in body


def test_cookie_jar_follows_set_cookie_and_forgets_cleared_sessions():
    jar = merge_cookies({}, ["session=abc; path=/; Max-Age=1209600; httponly; samesite=lax"])
    assert jar == {"session": "abc"}
    jar = merge_cookies(jar, ["other=1; path=/"])
    assert jar == {"session": "abc", "other": "1"}
    cleared = "session=null; path=/; expires=Thu, 01 Jan 1970 00:00:00 GMT; httponly"
    assert merge_cookies(jar, [cleared]) == {"other": "1"}


def test_verify_answer_is_kept_whole_and_a_masked_sample_is_a_failure():
    answer = {
        "responses_create_params": {"input": []},
        "response": {"output": []},
        "reward": 0.5,
        "accuracy": 1,
        "passed": True,
        "failure_kind": "format",
        "reward_components": {"a": 0.25},
        "extracted": {"answer": [1, 2]},
    }
    v = verdict_from_answer(answer)
    assert v.reward == 0.5
    assert v.info == {
        "accuracy": 1,
        "passed": True,
        "failure_kind": "format",
        "reward_components": {"a": 0.25},
        "extracted": {"answer": [1, 2]},
    }
    assert v.components == {"accuracy": 1.0, "reward_components.a": 0.25}
    assert v.details == {"failure_kind": "format"}
    with pytest.raises(EnvUnavailable, match="masked the sample"):
        verdict_from_answer({**answer, "mask_sample": True})


def test_an_unreachable_server_is_unavailable_never_a_tool_output():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    env = make_env("nemo-gym", base_url=url, retries=1, backoff_s=0.0)
    task = _task(counter_row("t", 0, [1]))

    async def call():
        try:
            state = env.reset(task)
            call = FunctionCall(call_id="c", name="increment_counter", arguments='{"count": 1}')
            return await env.acall_tool(task, state, call)
        finally:
            await env.aclose()

    with pytest.raises(EnvUnavailable, match=r"connection error on POST /seed_session.*2 attempts"):
        asyncio.run(call())


def test_sync_and_async_posts_retry_alike():
    """The rollout worker (async) and the verifier worker (sync ``verify``) retry a 503 the
    same number of times, and fail with the same message."""
    hits: list[str] = []

    class Overloaded(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            hits.append(self.path)
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"overloaded")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Overloaded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = make_env("nemo-gym", base_url=f"http://127.0.0.1:{server.server_port}",
                       retries=2, backoff_s=0.0)  # fmt: skip
        task = _task(counter_row("t", 0, [1]))
        traj = Trajectory(task_id=task.task_id, prompt_id=task.prompt_id, k=0, group_size=1,
                          env="nemo-gym", items=list(task.input), n_input=len(task.input),
                          turns=[], status="completed")  # fmt: skip
        expect = r"HTTP 503 from POST /seed_session: overloaded \(after 3 attempts\)"
        with pytest.raises(EnvUnavailable, match=expect):
            env.verify(task, traj, env.reset(task))
        assert hits == ["/seed_session"] * 3
        hits.clear()

        async def seed():
            try:
                return await env.aopen(task, env.reset(task))
            finally:
                await env.aclose()

        with pytest.raises(EnvUnavailable, match=expect):
            asyncio.run(seed())
        assert hits == ["/seed_session"] * 3
    finally:
        server.shutdown()
        server.server_close()
