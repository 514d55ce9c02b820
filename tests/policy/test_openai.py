"""The real ``openai`` backend against ``OpenAITestServer``: a stdlib HTTP server in this
process that samples from the tiny model with transformers and answers in vLLM's format."""

from __future__ import annotations

import asyncio
import copy
import socket

import pytest
import torch
from safetensors.torch import save_file

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig
from streamrl.defaults import POLICY_URL_ENV
from streamrl.models.tiny import build_model, build_tokenizer
from streamrl.policy import PolicyError, _chat, check_policy, make_policy
from streamrl.policy.base import PolicyRequest
from streamrl.policy.openai import OpenAIPolicy
from streamrl.schema import (
    FunctionCall,
    FunctionCallOutput,
    FunctionTool,
    Message,
    PolicyVersion,
    encode,
)
from tests.support.openai_server import OpenAITestServer

TOOLS = [FunctionTool(name="add", parameters={"type": "object", "properties": {}})]


@pytest.fixture
def server(tiny_dir):
    with OpenAITestServer(tiny_dir) as s:
        yield s


def make(
    url: str, *, model="tiny", temperature: float = 0.8, redis_url=None, run="default", **options
):
    config = PolicyConfig(
        backend="openai",
        base_url=url + "/v1",
        model=model,
        temperature=temperature,
        max_new_tokens=8,
        options={"backoff_s": 0.01, "retries": 2, "trust_env": False, "down_wait_s": 0, **options},
    )
    return OpenAIPolicy(config, None, redis_url=redis_url, run=run)


def request(task, turn: int = 0, tools=()) -> PolicyRequest:
    return PolicyRequest(task=task, items=list(task.input), tools=list(tools), turn=turn)


def run(policy, *requests, sequential: bool = False):
    async def main():
        try:
            if sequential:  # for scripted replies that must meet requests in order
                return [await policy.respond(r) for r in requests]
            return await asyncio.gather(*(policy.respond(r) for r in requests))
        finally:
            await policy.close()

    return asyncio.run(main())


def forward_logprobs(model, prompt, tokens, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_make_policy_builds_openai(server):
    config = PolicyConfig(backend="openai", base_url=server.url, model="tiny")
    assert isinstance(make_policy(config, None), OpenAIPolicy)


def test_a_pinned_server_and_requests_that_wait_for_its_slot(
    server, copy_task, r, redis_url, run_name, monkeypatch
):
    """``STREAMRL_POLICY_BASE_URL`` wins over ``base_url`` (one pool of workers per server);
    with ``max_inflight_per_server = 1`` concurrent requests wait for the slot (counted in
    ``requests``, which policy health reports) and all of them are answered."""
    monkeypatch.setenv(POLICY_URL_ENV, server.url + "/v1")
    policy = make("http://127.0.0.1:9", redis_url=redis_url, run=run_name,
                  max_inflight_per_server=1)  # fmt: skip
    assert policy.server == server.url
    seen: list[tuple[int, int]] = []

    async def main():
        async def watch():
            while True:
                seen.append(policy.requests)
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        try:
            return await asyncio.gather(
                *(policy.respond(request(copy_task(f"w{i}:0"))) for i in range(3))
            )
        finally:
            watcher.cancel()
            await policy.close()

    turns = asyncio.run(main())
    assert len(turns) == 3 and all(t.token_ids for t in turns)
    assert max(s[0] for s in seen) == 1 and max(s[1] for s in seen) >= 2, sorted(set(seen))
    assert policy.requests == (0, 0)
    assert r.zcard(Keys(run_name).server_slots(policy.server_id)) == 0


def test_base_url_as_a_list_spreads_workers_over_the_servers(
    server, tiny_dir, copy_task, redis_url, run_name
):
    """Two servers in ``base_url``: two workers are given one each (and keep it), and each
    answers from its own."""
    with OpenAITestServer(tiny_dir) as other:
        config = PolicyConfig(
            backend="openai",
            base_url=[server.url + "/v1", other.url + "/v1"],
            model="tiny",
            max_new_tokens=4,
            options={"trust_env": False, "retries": 0, "down_wait_s": 0},
        )
        check_policy(config)
        policies = [
            OpenAIPolicy(config, None, redis_url=redis_url, run=run_name, worker=f"w{i}")
            for i in range(2)
        ]

        async def main():
            try:
                for p in policies:
                    await p.refresh()
                return await asyncio.gather(
                    *(p.respond(request(copy_task(f"l{i}:0"))) for i, p in enumerate(policies))
                )
            finally:
                for p in policies:
                    await p.close()

        turns = asyncio.run(main())
        served = (len(server.chat_requests), len(other.chat_requests))
    assert sorted(p.server for p in policies) == sorted([server.url, other.url])
    assert all(t.token_ids for t in turns)
    assert served[0] and served[1], served


def test_token_ids_and_logprobs_round_trip(server, copy_task):
    policy = make(server.url)
    turns = run(policy, *(request(copy_task(f"t{i}:0")) for i in range(4)))
    tok = build_tokenizer()
    model = build_model(0).eval()
    for turn in turns:
        assert turn.prompt_token_ids == tok.convert_tokens_to_ids(
            ["<bos>", "<user>", "copy", ":", "a", "b", "c", "<assistant>"]
        )
        assert len(turn.token_ids) == len(turn.logprobs) > 0
        expected = forward_logprobs(model, turn.prompt_token_ids, turn.token_ids, 0.8)
        assert turn.logprobs == pytest.approx(expected, abs=1e-4)
        text_ids = turn.token_ids[:-1] if turn.finish_reason == "stop" else turn.token_ids
        (message,) = turn.items
        assert message.content == tok.decode(text_ids, skip_special_tokens=False).strip()
        assert turn.policy_version == 0
    body = server.chat_requests[0]
    assert body["logprobs"] is True and body["top_logprobs"] == 0
    assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
    assert body["skip_special_tokens"] is False
    assert body["messages"] == [{"role": "user", "content": "copy : a b c"}]
    assert len({b["seed"] for b in server.chat_requests}) == 4


def test_token_ids_from_logprob_tokens_when_the_server_omits_them(server, copy_task):
    with_ids = run(make(server.url), request(copy_task("x:0")))[0]
    without = run(
        make(server.url, extra_body={"return_token_ids": False}), request(copy_task("x:0"))
    )[0]
    assert server.chat_requests[-1]["return_token_ids"] is False  # extra_body overrides
    assert without.token_ids == with_ids.token_ids  # same seed, same tokens
    assert without.prompt_token_ids == []  # only return_token_ids carries the prompt


def test_stray_special_tokens_stay_in_the_text(tiny_dir, copy_task):
    with OpenAITestServer(tiny_dir) as server:
        turns = run(
            make(server.url, temperature=1.0), *(request(copy_task(f"s{i}:0")) for i in range(24))
        )
    bos = build_tokenizer().bos_token_id
    with_bos = [t for t in turns if bos in t.token_ids[:-1]]
    assert with_bos, "no sample emitted a stray <bos>; pick more tasks"
    assert all("<bos>" in t.items[0].content for t in with_bos)


def test_tool_calls_and_malformed_tool_calls(tiny_dir, copy_task):
    replies = iter(
        [
            'ok <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
            '<tool_call>{"name": "add", "arguments": {a: 1}</tool_call>',
        ]
    )
    with OpenAITestServer(tiny_dir, script=lambda body: next(replies)) as server:
        good, bad = run(
            make(server.url),
            request(copy_task("g:0"), turn=2, tools=TOOLS),
            request(copy_task("b:0"), turn=2, tools=TOOLS),
            sequential=True,
        )
        sent = server.chat_requests[0]
    assert good.items == [
        Message(role="assistant", content="ok"),
        FunctionCall(call_id="call_2_0", name="add", arguments='{"a": 1, "b": 2}'),
    ]
    assert bad.items == [
        FunctionCall(
            call_id="call_2_0", name="add", arguments='{"name": "add", "arguments": {a: 1}'
        )
    ]
    assert sent["tool_choice"] == "none"
    assert sent["tools"][0] == {
        "type": "function",
        "function": {"name": "add", "description": "", "parameters": TOOLS[0].parameters},
    }


def test_tool_prompt_system_describes_tools_for_a_template_without_them(tiny_dir, copy_task):
    """``tool_prompt = "system"``: no ``tools`` field (a plain ChatML template would drop it),
    the tools described first in the system message, and an earlier call written into the
    assistant's text in the form the model is asked to answer in."""
    t = copy_task("t:0")
    earlier = FunctionCall(call_id="call_0_0", name="add", arguments='{"a": 1}')
    items = [*t.input, earlier, FunctionCallOutput(call_id="call_0_0", output="2")]
    with OpenAITestServer(tiny_dir, script=lambda body: "3") as server:
        run(make(server.url, tool_prompt="system"),
            PolicyRequest(task=t, items=items, tools=TOOLS, turn=1))  # fmt: skip
        sent = server.chat_requests[0]
    assert "tools" not in sent and "tool_choice" not in sent
    system, *rest = sent["messages"]
    assert system == {"role": "system", "content": _chat.tool_prompt(TOOLS)}
    assert rest[-2] == {"role": "assistant", "content": _chat.hermes_call(earlier)}
    assert rest[-1] == {"role": "tool", "tool_call_id": "call_0_0", "content": "2"}
    with pytest.raises(ValueError, match="tool_prompt must be off or system"):
        make(server.url, tool_prompt="auto")


def test_transient_errors_are_retried(server, copy_task):
    server.fail_next(2, status=503)
    policy = make(server.url, retries=2)
    (turn,) = run(policy, request(copy_task("r:0")))
    assert turn.token_ids
    assert policy.http_attempts == 3


def test_persistent_errors_become_policy_errors(server, copy_task):
    server.fail_next(5, status=503)
    policy = make(server.url, retries=2)
    with pytest.raises(PolicyError, match="failed 3 times"):
        run(policy, request(copy_task("r:0")))
    assert policy.http_attempts == 3


def test_client_errors_are_not_retried(server, copy_task):
    server.fail_next(1, status=400)
    policy = make(server.url, retries=3)
    with pytest.raises(PolicyError, match="HTTP 400"):
        run(policy, request(copy_task("r:0")))
    assert policy.http_attempts == 1


def test_unreachable_server_is_a_policy_error(copy_task):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before we connect: refused
    policy = make(f"http://127.0.0.1:{port}", retries=1)
    with pytest.raises(PolicyError, match="ConnectError"):
        run(policy, request(copy_task("r:0")))


def _publish(r, run_name: str, pv: PolicyVersion) -> None:
    r.xadd(Keys(run_name).policy, {"p": encode(pv)})


def _lora(tmp_path, seed: int):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        build_model(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data.normal_(0, 0.5)
    directory = tmp_path / f"lora{seed}"
    model.save_pretrained(directory)
    return directory, copy.deepcopy(model).merge_and_unload().eval()


def test_lora_versions_switch_and_are_stamped(server, copy_task, r, redis_url, tmp_path):
    run_name = "lora"
    updater = make(server.url, redis_url=redis_url, run=run_name, sync="lora", reload_check_s=0)
    reader = make(server.url, redis_url=redis_url, run=run_name, reload_check_s=0)
    req = request(copy_task("l:0"))

    async def main():
        seen = [await updater.respond(req)]
        for version in (3, 4, 5):
            directory, merged = _lora(tmp_path, version)
            _publish(
                r, run_name, PolicyVersion(version=version, path=str(directory), format="lora")
            )
            turn = await updater.respond(req)
            expected = forward_logprobs(merged, turn.prompt_token_ids, turn.token_ids, 0.8)
            assert turn.logprobs == pytest.approx(expected, abs=1e-4)
            seen.append(turn)
        seen.append(await reader.respond(req))  # adopts what the updater loaded
        # No Redis at all: the adapter name in the response is what says who answered.
        plain = make(server.url, model="policy-v4")
        seen.append(await plain.respond(req))
        await plain.close()
        await updater.close()
        await reader.close()
        return seen

    turns = asyncio.run(main())
    assert [t.policy_version for t in turns] == [0, 3, 4, 5, 5, 4]
    assert [b["model"] for b in server.chat_requests] == [
        "tiny",
        "policy-v3",
        "policy-v4",
        "policy-v5",
        "policy-v5",
        "policy-v4",
    ]
    assert set(server.adapters) == {"policy-v4", "policy-v5"}  # keep_adapters = 2
    assert turns[4].token_ids == turns[3].token_ids  # same adapter, same seed


def test_full_weight_update_drains_pauses_and_stamps(tiny_dir, copy_task, r, redis_url, tmp_path):
    run_name = "weights"
    new = build_model(seed=1).eval()
    state = {k: v.contiguous() for k, v in new.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    req = request(copy_task("w:0"))
    with OpenAITestServer(tiny_dir, delay_s=0.3) as server:
        server.reset_refusals = 2  # vLLM: {"success": false} while blocks are held; retried
        policy = make(
            server.url, redis_url=redis_url, run=run_name, sync="weights", reload_check_s=0
        )

        async def main():
            first = asyncio.ensure_future(policy.respond(req))
            while not server.events:  # the first request is in flight on the server
                await asyncio.sleep(0.01)
            _publish(r, run_name, PolicyVersion(version=9, path=str(tmp_path)))
            after = await asyncio.gather(*(policy.respond(req) for _ in range(3)))
            before = await first
            await policy.close()
            return before, after

        before, after = asyncio.run(main())
    # The in-flight request finished on the old weights before the swap started.
    assert server.events[:5] == [
        "chat-start",
        "chat-end",
        "/pause",
        "rpc:reload_weights",
        "/reset_prefix_cache",
    ]
    resets = ["/reset_prefix_cache"] * 3  # refused twice, then done
    assert server.control_calls == ["/pause?mode=wait", *resets, "/resume"]
    assert policy.prefix_reset_failures == 0
    assert server.weights_version == 1  # one client, one update, however many requests
    assert before.policy_version == 0
    reference = build_model(0).eval()
    expected = forward_logprobs(reference, before.prompt_token_ids, before.token_ids, 0.8)
    assert before.logprobs == pytest.approx(expected, abs=1e-4)
    for turn in after:
        assert turn.policy_version == 9
        expected = forward_logprobs(new, turn.prompt_token_ids, turn.token_ids, 0.8)
        assert turn.logprobs == pytest.approx(expected, abs=1e-4)


def test_version_header_wins_over_own_bookkeeping(tiny_dir, copy_task, tmp_path):
    state = {k: v.contiguous() for k, v in build_model(seed=2).state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    with OpenAITestServer(tiny_dir, version_header=True) as server:
        policy = make(server.url, weights_method="reload_weights")

        async def main():
            await policy.load_version(PolicyVersion(version=5, path=str(tmp_path)))
            turn = await policy.respond(request(copy_task("h:0")))
            await policy.close()
            return turn

        turn = asyncio.run(main())
    assert policy.version == 5
    assert turn.policy_version == server.weights_version == 1
