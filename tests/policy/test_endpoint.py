"""The rollout worker's policy endpoint (``streamrl.policy.endpoint``) in front of the real
tiny Llama: a Responses API request and a chat completions request, each tied to its episode
(NeMo Gym's ``/ng-rollout/<key>/`` path, a bearer key, ``/episodes/<key>/`` with ``stream: true``
as verifiers' interception server asks), recorded with the same prompt token ids
the backend renders for the conversation and one behaviour log-prob per sampled token; a key
that is not open is refused and recorded nowhere."""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from streamrl.policy.base import PolicyRequest
from streamrl.policy.endpoint import PolicyEndpoint
from streamrl.schema import FunctionCall, FunctionCallOutput, Message
from tests.policy.test_hf import make


def test_endpoint_records_each_turn_on_its_episode(tiny_dir, copy_task):
    policy = make(tiny_dir, max_new_tokens=6)
    task = copy_task("k0001:1")
    convo = [{"role": "user", "content": "copy: a b c"}]

    async def main():
        endpoint = PolicyEndpoint(policy, "127.0.0.1", 0, model="tiny")
        await endpoint.start()
        capture = endpoint.open("k0001-a1", task)
        streamed_capture = endpoint.open("k0001-b1", task)
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                url = f"{endpoint.url}/ng-rollout/k0001-a1/v1/responses"
                first = await client.post(url, json={"input": convo, "max_output_tokens": 4})
                chat = await client.post(
                    f"{endpoint.url}/v1/chat/completions",
                    headers={"authorization": "Bearer k0001-a1"},
                    json={
                        "messages": [
                            *convo,
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": "c1", "type": "function",
                                 "function": {"name": "look", "arguments": "{}"}}]},
                            {"role": "tool", "tool_call_id": "c1", "content": "seen"},
                        ],
                    },
                )  # fmt: skip
                # verifiers' interception server asks with stream=true: server-sent events
                streamed = await client.post(
                    f"{endpoint.url}/episodes/k0001-b1/v1/chat/completions",
                    json={"messages": convo, "stream": True, "max_tokens": 3},
                )
                other = await client.post(
                    f"{endpoint.url}/ng-rollout/k0001/v1/responses", json={"input": "hi"}
                )
        finally:
            endpoint.close("k0001-a1")
            endpoint.close("k0001-b1")
            await endpoint.stop()
        return first, chat, streamed, other, capture, streamed_capture

    first, chat, streamed, other, capture, streamed_capture = asyncio.run(main())
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["object"] == "response" and body["output"][0]["type"] == "message"
    assert body["usage"]["output_tokens"] <= 4
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["role"] == "assistant"
    # another attempt's key (attempt 0 of the same rollout) is not open: refused, not recorded
    assert other.status_code == 404 and "no open episode" in other.text
    assert streamed.status_code == 200, streamed.text
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = [e for e in streamed.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and len(events) == 2, streamed.text
    chunk = json.loads(events[0].removeprefix("data: "))
    assert chunk["object"] == "chat.completion.chunk", chunk
    assert chunk["choices"][0]["delta"]["role"] == "assistant", chunk
    assert chunk["choices"][0]["finish_reason"] in ("stop", "length"), chunk
    assert len(streamed_capture.turns) == 1 and streamed_capture.turns[0].token_ids
    assert [t.index for t in capture.turns] == [0, 1]
    for turn in capture.turns:
        assert turn.token_ids and len(turn.logprobs) == len(turn.token_ids)
        assert all(math.isfinite(x) and x <= 0 for x in turn.logprobs)
    # the prompt is the backend's own rendering of the conversation the request carried
    items = [Message(role="user", content="copy: a b c")]
    rendered = policy._render(PolicyRequest(task=task, items=items, tools=[]))
    assert capture.turns[0].prompt_token_ids == rendered
    assert isinstance(capture.items[1], FunctionCall) and capture.items[1].call_id == "c1"
    assert isinstance(capture.items[2], FunctionCallOutput) and capture.items[2].output == "seen"


def test_a_second_endpoint_on_a_taken_address_fails_to_start(tiny_dir):
    """What makes a second rollout worker on the same ``policy_endpoint`` fail its lease before
    it takes a task: the address is held."""
    policy = make(tiny_dir)

    async def main():
        first = PolicyEndpoint(policy, "127.0.0.1", 0)
        await first.start()
        try:
            second = PolicyEndpoint(policy, "127.0.0.1", first.port)
            with pytest.raises(OSError, match="cannot listen"):
                await second.start()
        finally:
            await first.stop()

    asyncio.run(main())
