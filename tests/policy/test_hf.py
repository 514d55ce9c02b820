"""The ``hf`` backend against the real tiny Llama: batching, behaviour log-probs, weight
reloads from the policy stream, and what the decoded text keeps."""

from __future__ import annotations

import asyncio

import pytest
import torch
from safetensors.torch import save_file

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig
from streamrl.models.kv import cache_name
from streamrl.models.tiny import build_model, build_tokenizer
from streamrl.policy import make_policy
from streamrl.policy.base import PolicyRequest
from streamrl.policy.hf import HFPolicy
from streamrl.schema import Message, PolicyVersion, Task, encode
from tests.support import TEST_DEVICE

EOS = build_tokenizer().eos_token_id
BOS = build_tokenizer().bos_token_id


def make(tiny_dir, temperature: float = 1.0, max_new_tokens: int = 8, **options) -> HFPolicy:
    config = PolicyConfig(
        backend="hf",
        model=str(tiny_dir),
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        options={"device": TEST_DEVICE, "dtype": "float32", **options},
    )
    return HFPolicy(config, None)


def request(task, turn: int = 0) -> PolicyRequest:
    return PolicyRequest(task=task, items=list(task.input), tools=[], turn=turn)


async def gather(policy, requests):
    return await asyncio.gather(*(policy.respond(r) for r in requests))


def forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float):
    """log_softmax(logits / T) at the sampled tokens, from one unpadded forward pass."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    positions = range(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    return [logp[p, t].item() for p, t in zip(positions, tokens, strict=True)]


def test_make_policy_builds_hf(tiny_dir):
    config = PolicyConfig(backend="hf", model=str(tiny_dir), options={"device": TEST_DEVICE})
    assert isinstance(make_policy(config, None, run="x"), HFPolicy)


def test_concurrent_requests_share_one_generate(tiny_dir, copy_task):
    policy = make(tiny_dir)
    turns = asyncio.run(gather(policy, [request(copy_task(f"p{i}:0")) for i in range(6)]))
    assert policy.generate_calls == 1
    assert policy.batch_sizes == [6]
    assert [t.index for t in turns] == [0] * 6
    assert all(t.token_ids for t in turns)


def test_max_batch_splits_and_late_requests_form_the_next_batch(tiny_dir, copy_task):
    policy = make(tiny_dir, max_batch=4)

    async def main():
        first = [policy.respond(request(copy_task(f"p{i}:0"))) for i in range(5)]
        tasks = [asyncio.ensure_future(c) for c in first]
        await asyncio.sleep(0)  # the runner has taken its first batch
        late = [asyncio.ensure_future(policy.respond(request(copy_task("late:0"))))]
        return await asyncio.gather(*tasks, *late)

    turns = asyncio.run(main())
    assert len(turns) == 6
    assert policy.batch_sizes[0] == 4
    assert sum(policy.batch_sizes) == 6
    assert policy.generate_calls == len(policy.batch_sizes) <= 3


def test_logprobs_are_the_sampling_distribution_at_the_sampled_tokens(tiny_dir, copy_task):
    temperature = 0.7
    policy = make(tiny_dir, temperature=temperature, max_new_tokens=12)
    # Different prompt lengths, so the batch is left-padded.
    tasks = [copy_task("a:0", "a b c"), copy_task("b:0", "a b c d e f g h"), copy_task("c:0", "p")]
    turns = asyncio.run(gather(policy, [request(t) for t in tasks]))
    assert policy.generate_calls == 1
    reference = build_model(0).eval()
    for turn in turns:
        assert len(turn.logprobs) == len(turn.token_ids) > 0
        expected = forward_logprobs(reference, turn.prompt_token_ids, turn.token_ids, temperature)
        assert turn.logprobs == pytest.approx(expected, abs=1e-4)
        # ... and not the untempered model's log-probs.
        raw = forward_logprobs(reference, turn.prompt_token_ids, turn.token_ids, 1.0)
        assert turn.logprobs != pytest.approx(raw, abs=1e-3)


@pytest.mark.parametrize("vocab", [49152, 50257, 1000, 7])
def test_blocked_inverse_cdf_draws_what_the_whole_cumulative_sum_draws(vocab):
    """The sampler places a draw in a block of the vocabulary by the blocks' sums, then inside
    it: the same tokens as the textbook inverse CDF over the whole vocabulary (vocabularies a
    multiple of the block or not), masked tokens never drawn, uniforms at both ends included,
    and the log-normalizer ``logsumexp``."""
    from streamrl.policy.hf.decode import _inverse_cdf

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn((256, vocab), generator=g) * 4
    if vocab > 7:
        x[:, ::3] = float("-inf")  # masked, among them a block's first and last entries
    u = torch.rand(256, generator=g)
    u[:2] = torch.tensor([0.0, 1.0 - 2**-24])
    nxt, log_z = _inverse_cdf(x, u)
    cdf = torch.softmax(x.double(), dim=-1).cumsum(dim=-1)
    expected = torch.searchsorted(cdf, u[:, None].double() * cdf[:, -1:], right=True)[:, 0]
    # float32 sums against float64: a draw may land on a neighbour only within rounding
    off = (nxt != expected.clamp(max=vocab - 1)).sum().item()
    assert off <= 1, off
    assert torch.isfinite(x.gather(1, nxt[:, None])).all()
    assert log_z == pytest.approx(torch.logsumexp(x, dim=-1), abs=1e-5)
    picked = torch.bincount(nxt, minlength=vocab)
    assert picked.size(0) == vocab  # never past the vocabulary


def test_model_generation_defaults_do_not_reshape_sampling(tiny_dir, copy_task, tmp_path):
    """A model that ships sampling defaults (as Qwen and Llama do) is still sampled from
    softmax(logits / T) alone, so the recorded log-probs stay the learner's to recompute."""
    import json
    import shutil

    directory = shutil.copytree(tiny_dir, tmp_path / "shipped")
    config = json.loads((directory / "generation_config.json").read_text())
    config |= {"do_sample": True, "temperature": 0.3, "top_k": 2, "top_p": 0.5}
    config |= {"repetition_penalty": 3.0, "no_repeat_ngram_size": 1, "min_new_tokens": 4}
    (directory / "generation_config.json").write_text(json.dumps(config))
    policy = make(directory, temperature=1.0, max_new_tokens=12)
    turns = asyncio.run(gather(policy, [request(copy_task(f"g{i}:0")) for i in range(4)]))
    reference = build_model(0).eval()
    for turn in turns:
        expected = forward_logprobs(reference, turn.prompt_token_ids, turn.token_ids, 1.0)
        assert turn.logprobs == pytest.approx(expected, abs=1e-4)


def test_prompt_is_the_chat_template(tiny_dir, copy_task):
    policy = make(tiny_dir)
    turn = asyncio.run(policy.respond(request(copy_task("a:0", "a b c"))))
    tok = build_tokenizer()
    assert turn.prompt_token_ids == tok.convert_tokens_to_ids(
        ["<bos>", "<user>", "copy", ":", "a", "b", "c", "<assistant>"]
    )


def test_tokens_stop_at_eos_or_length_and_text_keeps_special_tokens(tiny_dir, copy_task):
    max_new = 8
    policy = make(tiny_dir, temperature=1.0, max_new_tokens=max_new)
    tok = build_tokenizer()
    turns = asyncio.run(gather(policy, [request(copy_task(f"s{i}:0")) for i in range(24)]))
    reasons = {t.finish_reason for t in turns}
    assert reasons == {"stop", "length"}  # the seeded model and seeds exercise both
    saw_bos = False
    for t in turns:
        # An untrained model may *sample* <pad>; what must never appear is generate's
        # padding after the eos, so every turn ends exactly at its eos or at the limit.
        if t.finish_reason == "stop":
            assert t.token_ids[-1] == EOS and EOS not in t.token_ids[:-1]
            text_ids = t.token_ids[:-1]
        else:
            assert len(t.token_ids) == max_new and EOS not in t.token_ids
            text_ids = t.token_ids
        (message,) = t.items
        assert isinstance(message, Message) and message.role == "assistant"
        assert message.content == tok.decode(text_ids, skip_special_tokens=False).strip()
        assert "<eos>" not in message.content
        if BOS in text_ids:
            saw_bos = True
            assert "<bos>" in message.content
    assert saw_bos, "no sample emitted a stray <bos>; pick more tasks"


def test_same_task_and_turn_sample_the_same_tokens_in_any_batch(tiny_dir, copy_task):
    policy = make(tiny_dir, max_new_tokens=10)
    alone = asyncio.run(policy.respond(request(copy_task("x:1"))))
    crowd = asyncio.run(
        gather(
            policy,
            [request(copy_task(f"o{i}:0", "d e")) for i in range(3)] + [request(copy_task("x:1"))],
        )
    )
    assert crowd[-1].token_ids == alone.token_ids
    other_turn = asyncio.run(policy.respond(request(copy_task("x:1"), turn=1)))
    assert other_turn.token_ids != alone.token_ids


def _publish(r, run: str, version: int, directory) -> None:
    pv = PolicyVersion(version=version, step=version, path=str(directory), format="safetensors")
    r.xadd(Keys(run).policy, {"p": encode(pv)})


def test_reloads_weights_announced_on_the_policy_stream(
    tiny_dir, copy_task, r, redis_url, tmp_path
):
    run = "reload"
    policy = HFPolicy(
        PolicyConfig(
            backend="hf",
            model=str(tiny_dir),
            temperature=1.0,
            max_new_tokens=6,
            options={"device": TEST_DEVICE, "reload_check_s": 0},
        ),
        None,
        redis_url=redis_url,
        run=run,
    )
    req = request(copy_task("r:0"))

    async def main():
        before = await policy.respond(req)
        new = build_model(seed=1)
        save_file(
            {k: v.contiguous() for k, v in new.state_dict().items()}, tmp_path / "model.safetensors"
        )
        _publish(r, run, 7, tmp_path)
        after = await policy.respond(req)
        await policy.close()
        return before, after, new.eval()

    before, after, new = asyncio.run(main())
    assert before.policy_version == 0
    assert after.policy_version == 7 and policy.version == 7
    assert (after.token_ids, after.logprobs) != (before.token_ids, before.logprobs)
    expected = forward_logprobs(new, after.prompt_token_ids, after.token_ids, 1.0)
    assert after.logprobs == pytest.approx(expected, abs=1e-4)


def test_lag_versions_serves_an_older_announced_version(tiny_dir, copy_task, r, redis_url):
    """Off-policy experiments hold rollouts back: with lag_versions=2 the backend serves the
    version announced two announcements before the newest."""
    run = "lag"
    policy = HFPolicy(
        PolicyConfig(
            backend="hf", model=str(tiny_dir), options={"reload_check_s": 0, "lag_versions": 2}
        ),
        None,
        redis_url=redis_url,
        run=run,
    )
    req = request(copy_task("l:0"))

    async def main():
        seen = []
        for v in range(1, 6):
            _publish(r, run, v, tiny_dir)
            seen.append((await policy.respond(req)).policy_version)
        await policy.close()
        return seen

    # 1 -> only v1 exists (oldest); 2 -> v1; 3 -> v1; 4 -> v2; 5 -> v3
    assert asyncio.run(main()) == [1, 1, 1, 2, 3]


def test_a_bad_checkpoint_keeps_the_old_weights(tiny_dir, copy_task, r, redis_url, tmp_path):
    run = "bad"
    policy = HFPolicy(
        PolicyConfig(backend="hf", model=str(tiny_dir), options={"reload_check_s": 0}),
        None,
        redis_url=redis_url,
        run=run,
    )
    req = request(copy_task("r:0"))
    state = build_model(seed=1).state_dict()
    state.pop("lm_head.weight")
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file({k: v.contiguous() for k, v in state.items()}, tmp_path / "model.safetensors")

    async def main():
        before = await policy.respond(req)
        _publish(r, run, 2, tmp_path)
        after = await policy.respond(req)
        await policy.close()
        return before, after

    before, after = asyncio.run(main())
    assert after.policy_version == 0
    assert after.token_ids == before.token_ids
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-6)


def test_reloads_lora_adapters(tiny_dir, copy_task, r, redis_url, tmp_path):
    """v1 wraps the model with peft, v2 (same adapter shape) swaps the adapter weights."""
    import copy

    from peft import LoraConfig, get_peft_model

    run = "lora"
    policy = HFPolicy(
        PolicyConfig(
            backend="hf", model=str(tiny_dir), max_new_tokens=6, options={"reload_check_s": 0}
        ),
        None,
        redis_url=redis_url,
        run=run,
    )
    req = request(copy_task("r:0"))
    trained = get_peft_model(
        build_model(0), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )

    async def main():
        seen = [await policy.respond(req)]
        for version in (1, 2):
            torch.manual_seed(version)
            for name, p in trained.named_parameters():
                if "lora_" in name:
                    p.data.normal_(0, 0.5)  # a visible update, as training would make
            directory = tmp_path / f"v{version}"
            trained.save_pretrained(directory)
            pv = PolicyVersion(version=version, path=str(directory), format="lora")
            r.xadd(Keys(run).policy, {"p": encode(pv)})
            turn = await policy.respond(req)
            assert turn.policy_version == version
            merged = copy.deepcopy(trained).merge_and_unload().eval()
            expected = forward_logprobs(merged, turn.prompt_token_ids, turn.token_ids, 1.0)
            assert turn.logprobs == pytest.approx(expected, abs=1e-4)
            seen.append(turn)
        await policy.close()
        return seen

    base, v1, v2 = asyncio.run(main())
    assert v1.logprobs != pytest.approx(base.logprobs, abs=1e-3)
    assert v2.logprobs != pytest.approx(v1.logprobs, abs=1e-3)


def test_decode_loop_samples_what_generate_samples_with_one_prefill_per_prompt(tiny_dir, copy_task):
    """Groups share their prompt: the loop prefills each distinct prompt once, and still
    samples the tokens (and log-probs) transformers' generate samples."""
    texts = ["c d e", "a b c d e", "f g h"]
    tasks = [copy_task(f"p{g}:{k}", texts[g]) for g in range(3) for k in range(4)]
    loop, generate = make(tiny_dir, max_new_tokens=6), make(tiny_dir, max_new_tokens=6)
    generate.decode = "generate"
    prefill_rows: list[int] = []

    def first_forward(_module, _args, kwargs):
        if kwargs.get(cache_name()) is None:
            prefill_rows.append(kwargs["input_ids"].size(0))

    loop.model.register_forward_pre_hook(first_forward, with_kwargs=True)
    ours = asyncio.run(gather(loop, [request(t) for t in tasks]))
    theirs = asyncio.run(gather(generate, [request(t) for t in tasks]))
    assert loop.generate_calls == generate.generate_calls == 1
    assert prefill_rows == [3]  # 12 rows, 3 distinct prompts (two lengths: left padding)
    assert [t.token_ids for t in ours] == [t.token_ids for t in theirs]
    assert len({tuple(t.token_ids) for t in ours}) > 3  # samples of a prompt differ
    for a, b in zip(ours, theirs, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.finish_reason == b.finish_reason


@pytest.mark.parametrize("case", ["first turn", "later turn", "distinct prompts"])
def test_decode_loop_prefills_shared_heads_once_and_whole_prompts_in_one_pass(tiny_dir, case):
    """A first turn's group is one prompt repeated: one prompt pass. Later turns share the
    group's first prompt and differ after it, and distinct prompts share the template's
    opening: the heads once, then every row's tail on top. Either way, the tokens and
    log-probs that generate samples."""
    from streamrl.policy.hf.decode import Sampler

    policy = make(tiny_dir)
    head = [BOS, 5, 6, 7, 8, 9]
    if case == "distinct prompts":  # six prompts, each alone, sharing their first 5 tokens
        rows = [[*head[:5], 10 + i, 15 + i] for i in range(5)] + [[*head[:5], 20]]
        heads = [r[:5] for r in rows]
    else:
        rows = [head + ([10 + i, 11] if case == "later turn" else [10]) for i in range(4)]
        rows += [[BOS, 12, 13], [BOS, 12, 13]]  # another group, shorter: left padding
        heads = [r[:6] for r in rows[:4]] + [r[:2] for r in rows[4:]]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), policy._decoder.pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = torch.tensor(r), 1
    u = torch.rand((len(rows), 5), generator=torch.Generator().manual_seed(3))
    # on the policy's device, as HFPolicy._generate hands them over (STREAMRL_TEST_DEVICE=cuda)
    ids, mask, u = ids.to(policy.device), mask.to(policy.device), u.to(policy.device)
    passes: list[tuple[int, int, bool]] = []  # rows, width, with a cache
    hook = lambda _m, _a, kw: passes.append(  # noqa: E731
        (kw["input_ids"].size(0), kw["input_ids"].size(1), kw.get(cache_name()) is not None)
    )
    handle = policy.model.register_forward_pre_hook(hook, with_kwargs=True)
    loop, generate = Sampler(u, 1.0), Sampler(u, 1.0)
    with torch.inference_mode():
        policy._decoder.sample(policy.model, ids, mask, loop, 5, loop=True, heads=heads)
        prompt_passes = [p for p in passes if p[1] > 1]
        handle.remove()
        policy._decoder.sample(policy.model, ids, mask, generate, 5, loop=False)
    if case == "later turn":  # 2 distinct heads, then 6 tails of 2 tokens on the heads' cache
        assert prompt_passes == [(2, 6, False), (6, 2, True)]
    elif case == "distinct prompts":  # the opening once, then 6 tails of up to 2 tokens
        assert prompt_passes == [(1, 5, False), (6, 2, True)]
    else:  # 2 distinct prompts, no tail pass (heads would run more positions)
        assert prompt_passes == [(2, width, False)]
    assert loop.tokens == generate.tokens
    for t, a, b in zip(loop.tokens, loop.logprobs, generate.logprobs, strict=True):
        n = t.index(EOS) + 1 if EOS in t else len(t)  # after eos: padding, differently fed
        assert a[:n] == pytest.approx(b[:n], abs=1e-5)


def test_rows_alone_in_their_prompt_take_the_opening_every_row_shares():
    """The heads the batcher hands the decode loop: a group's common prefix for its rows, the
    batch's common opening for a row alone, and never a whole row (every row keeps a tail)."""
    from streamrl.policy.hf.batching import _Pending, _shared_heads

    def pending(prompt_id: str, ids: list[int]) -> _Pending:
        task = Task(task_id=f"{prompt_id}:0", prompt_id=prompt_id, k=0, group_size=1, env="copy",
                    input=[Message(role="user", content="x")])  # fmt: skip
        return _Pending(PolicyRequest(task=task, items=list(task.input), tools=[]), None, ids)

    batch = [pending("a", [1, 2, 3, 9, 9]), pending("a", [1, 2, 3, 9, 8])]  # a group
    batch += [pending("b", [1, 2, 3, 4]), pending("c", [1, 2, 5])]  # alone
    assert _shared_heads(batch) == [[1, 2, 3, 9], [1, 2, 3, 9], [1, 2], [1, 2]]
    assert _shared_heads(batch[2:3]) == [[1, 2, 3]]  # alone in the batch: all but its last
    assert _shared_heads([pending("b", [1, 2]), pending("c", [3, 4])]) == [[1], [3]]


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="packed weights are for CPU models")
def test_packed_linears_give_the_models_logits_and_follow_new_weights(tiny_dir):
    """The decode loop's oneDNN layers: the logits of the model's own (to float noise), used
    only inside the loop, and each layer repacked when a policy version is loaded in place."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamrl.policy.hf.packed import MIN_WEIGHT, PackedLinears

    policy = make(tiny_dir)
    model = policy.model
    assert isinstance(policy._decoder.packed, PackedLinears)
    assert policy._decoder.packed.fits(model) == []  # the tiny model's layers are all small
    every = PackedLinears(min_weight=0)  # so pack them all here
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert every.fits(model) == linears and model.lm_head in linears
    ids = torch.tensor([[BOS, 5, 6, 7], [BOS, 9, 10, 11]])
    with torch.inference_mode():
        plain = model(input_ids=ids).logits
        with every.on(model):
            packed = model(input_ids=ids).logits
        assert not any("forward" in vars(m) for m in linears)  # the model's own again
        assert len(every._packed) == len(linears)  # the packed path ran, for every layer
        assert torch.allclose(packed, plain, atol=1e-5, rtol=1e-5)
        state = {k: v * 1.5 if "proj" in k or k == "lm_head.weight" else v
                 for k, v in model.state_dict().items()}  # fmt: skip
        model.load_state_dict(state)  # a new version, in place
        changed = model(input_ids=ids).logits
        with every.on(model):
            assert torch.allclose(model(input_ids=ids).logits, changed, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(changed, plain, atol=1e-3)
    # by default only layers of MIN_WEIGHT elements or more; other dtypes keep their own
    wide = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512,
                                        num_hidden_layers=1, num_attention_heads=4,
                                        num_key_value_heads=2))  # fmt: skip
    big = [
        m for m in wide.modules() if type(m) is torch.nn.Linear and m.weight.numel() >= MIN_WEIGHT
    ]
    assert PackedLinears().fits(wide) == big and len(big) == 5  # q, o, gate, up, down
    assert PackedLinears().fits(wide.to(torch.float16)) == []
    assert make(tiny_dir, packed_weights=False)._decoder.packed is None


def test_every_torch_call_runs_on_the_policys_one_compute_thread(
    tiny_dir, copy_task, r, redis_url, tmp_path, monkeypatch
):
    """torch's OpenMP workers are fast only while one OS thread makes torch calls
    (``streamrl.policy.hf.compute``): loading the model, every decode call and every version
    load run on one thread, never on the event loop's."""
    import threading

    from transformers import AutoModelForCausalLM

    threads: dict[str, set[int]] = {"load": set(), "forward": set(), "version": set()}
    real = AutoModelForCausalLM.from_pretrained

    def from_pretrained(*args, **kwargs):
        threads["load"].add(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    config = PolicyConfig(backend="hf", model=str(tiny_dir), max_new_tokens=4,
                          options={"device": TEST_DEVICE, "reload_check_s": 0})  # fmt: skip
    policy = HFPolicy(config, None, redis_url=redis_url, run="one-thread")
    policy.model.register_forward_pre_hook(lambda *_: threads["forward"].add(threading.get_ident()))
    load = policy._weights.load

    def load_version(pv):
        threads["version"].add(threading.get_ident())
        load(pv)

    monkeypatch.setattr(policy._weights, "load", load_version)

    async def main():
        first = await gather(policy, [request(copy_task(f"t:{i}")) for i in range(3)])
        save_file({k: v.contiguous() for k, v in build_model(seed=1).state_dict().items()},
                  tmp_path / "model.safetensors")  # fmt: skip
        _publish(r, "one-thread", 3, tmp_path)
        second = await policy.respond(request(copy_task("u:0")))
        await policy.close()
        return first, second

    first, second = asyncio.run(main())
    assert second.policy_version == 3 and first[0].policy_version == 0
    assert all(len(ids) == 1 for ids in threads.values()), threads
    (one,) = set.union(*threads.values())
    assert one != threading.main_thread().ident


def test_decode_option_is_checked(tiny_dir):
    with pytest.raises(ValueError, match="decode must be loop or generate"):
        make(tiny_dir, decode="beam")
