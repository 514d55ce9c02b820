"""The decode loop's in-place KV cache and the ``ignore_eos`` option."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicLayer

from streamrl.models.kv import cache_of, with_cache
from streamrl.policy.hf.cache import RoomyLayer, roomy
from tests.policy.test_hf import EOS, gather, make, request


def _decode(model, ids, steps: int, room: int | None) -> tuple[list[torch.Tensor], object]:
    """Greedy steps after a prefill, with the cache made roomy (``room`` positions) or not."""
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, logits = cache_of(out), [out.logits[:, -1]]
        if room is not None:
            roomy(cache, room)
        for _ in range(steps):
            out = model(input_ids=logits[-1].argmax(-1)[:, None], use_cache=True,
                        **with_cache(cache))  # fmt: skip
            cache = cache_of(out)
            logits.append(out.logits[:, -1])
    return logits, cache


def test_roomy_cache_decodes_what_the_dynamic_cache_decodes_and_grows_past_its_room(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (3, 7), generator=gen)
    plain, plain_cache = _decode(model, ids, 9, None)
    assert all(type(layer) is DynamicLayer for layer in plain_cache.layers)
    for room in (9, 4):  # room for every step; room for 4, then concatenation
        mine, cache = _decode(model, ids, 9, room)
        assert all(isinstance(layer, RoomyLayer) for layer in cache.layers)
        for a, b in zip(mine, plain, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert cache.get_seq_length() == plain_cache.get_seq_length() == 7 + 9
        grew = cache.layers[0].keys.data_ptr() != cache.layers[0].buffers[0].data_ptr()
        assert grew == (room < 9)  # in place while there was room


def test_ignore_eos_runs_every_row_to_its_limit(tiny_dir, copy_task):
    max_new = 8
    tasks = [copy_task(f"s{i}:0") for i in range(24)]
    stopping = asyncio.run(gather(make(tiny_dir, max_new_tokens=max_new), map(request, tasks)))
    stopped = [t for t in stopping if t.finish_reason == "stop"]
    assert stopped, "no row sampled its eos: pick more tasks"
    running = make(tiny_dir, max_new_tokens=max_new, ignore_eos=True)
    ran = asyncio.run(gather(running, [request(t) for t in tasks]))
    assert {t.finish_reason for t in ran} == {"length"}
    assert all(len(t.token_ids) == max_new for t in ran)
    for a, b in zip(stopping, ran, strict=True):  # the same draws, the rows go on past eos
        assert b.token_ids[: len(a.token_ids)] == a.token_ids
    assert any(EOS in t.token_ids[:-1] for t in ran)


def test_ignore_eos_needs_the_decode_loop(tiny_dir):
    with pytest.raises(ValueError, match="ignore_eos needs decode = loop"):
        make(tiny_dir, decode="generate", ignore_eos=True)
