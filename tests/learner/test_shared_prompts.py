"""The learner runs a group's shared prompt once (train.shifted_logits): the loss, gradients and
entropy must be those of running every sequence whole, and the saving must really happen."""

from __future__ import annotations

import msgspec
import pytest
import torch
from groupdata import make_groups

from streamrl.learner.batch import make_batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.train import batch_loss, shifted_logits
from streamrl.models.tiny import build_tokenizer


def _loss_and_grads(model, batch, cfg):
    model.zero_grad(set_to_none=True)
    out = batch_loss(model, batch, cfg)
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _forwards(model) -> list[int]:
    calls: list[int] = []
    model.register_forward_pre_hook(lambda m, args, kwargs: calls.append(1), with_kwargs=True)
    return calls


# micro-batches of 6 sequences cut groups of 4 apart: a chunk holds parts of two groups
@pytest.mark.parametrize("micro", [0, 6])
def test_shared_prompts_give_the_loss_and_gradients_of_whole_sequences(tiny_dir, micro):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.train()
    batch = make_batch(make_groups(tiny_dir, 5, seed=3), build_tokenizer().pad_token_id, "group")
    assert len(set(batch.prompt_lens)) == 1  # copy: every prompt is 8 tokens
    cfg = LearnerConfig(model=str(tiny_dir), micro_batch_size=micro, max_completion_length=4)
    calls = _forwards(model)
    shared, g_shared = _loss_and_grads(model, batch, cfg)
    chunks = len(batch.chunks(micro))
    assert len(calls) == 2 * chunks  # the prompts once, then the completions
    calls.clear()
    plain_cfg = msgspec.structs.replace(cfg, share_prompts=False)
    whole, g_whole = _loss_and_grads(model, batch, plain_cfg)
    assert len(calls) == chunks
    assert shared.loss == pytest.approx(whole.loss, abs=1e-6)
    assert shared.entropy == pytest.approx(whole.entropy, rel=1e-5)
    assert whole.loss != 0.0
    for name, g in g_whole.items():
        torch.testing.assert_close(g_shared[name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_prompts_of_different_lengths_run_whole(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ids = torch.randint(6, 24, (4, 10))
    attn = torch.ones_like(ids)
    calls = _forwards(model)
    mixed = shifted_logits(model, ids, attn, [8, 8, 7, 7])
    assert len(calls) == 1
    calls.clear()
    distinct = shifted_logits(model, ids, attn, [8, 8, 8, 8])  # no two rows share a prompt
    assert len(calls) == 1
    whole = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    torch.testing.assert_close(mixed, whole)
    torch.testing.assert_close(distinct, whole)
