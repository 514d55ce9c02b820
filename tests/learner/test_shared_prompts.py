"""The learner runs a group's shared prompt once (logits.shifted_logits): the loss, gradients and
entropy must be those of running every sequence whole, and the saving must really happen."""

from __future__ import annotations

import msgspec
import pytest
import torch
from groupdata import make_groups

from streamrl.learner.batch import make_batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.logits import shifted_logits
from streamrl.learner.train import batch_loss
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


def test_prompts_of_different_lengths_share_the_shortest_head(tiny_dir):
    """Rows whose prompts differ in length (two prompts of a batch; an episode's chained turns)
    still run the tokens they share once: the head is the shortest prompt's length."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    ids = torch.randint(6, 24, (4, 10))
    ids[:, :7] = ids[0, :7]  # every row starts with the same 7 tokens
    attn = torch.ones_like(ids)
    whole = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    calls = _forwards(model)
    mixed = shifted_logits(model, ids, attn, [8, 8, 7, 7])
    assert len(calls) == 2  # the shared 7 tokens once, then each row's rest
    torch.testing.assert_close(mixed[:, 6:], whole[:, 6:], atol=1e-5, rtol=1e-4)
    calls.clear()
    distinct = shifted_logits(model, torch.randint(6, 24, (4, 10)), attn, [8, 8, 8, 8])
    assert len(calls) == 1  # no two rows share a head: one plain forward
    assert distinct.shape == whole.shape


def test_the_reference_model_shares_prompts_too(tiny_dir):
    """With beta > 0 the reference model's log-probs take the same shared-prompt path: the KL
    term, and so the loss and gradients, match running every sequence whole."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.train()
    ref = AutoModelForCausalLM.from_pretrained(tiny_dir)
    with torch.no_grad():  # a reference that differs from the policy: the KL is not zero
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = make_batch(make_groups(tiny_dir, 3, seed=5), build_tokenizer().pad_token_id, "group")
    cfg = LearnerConfig(model=str(tiny_dir), max_completion_length=4, beta=0.1)
    ref_calls = _forwards(ref)
    model.zero_grad(set_to_none=True)
    shared = batch_loss(model, batch, cfg, ref_model=ref)
    g_shared = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert len(ref_calls) == 2  # the prompts once, then the completions
    ref_calls.clear()
    plain_cfg = msgspec.structs.replace(cfg, share_prompts=False)
    model.zero_grad(set_to_none=True)
    whole = batch_loss(model, batch, plain_cfg, ref_model=ref)
    assert len(ref_calls) == 1
    g_whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    no_kl_cfg = msgspec.structs.replace(plain_cfg, beta=0.0)
    no_kl = batch_loss(model, batch, no_kl_cfg, ref_model=ref, backward=False)
    assert abs(whole.loss - no_kl.loss) > 1e-4  # the KL term is really in the loss
    assert shared.loss == pytest.approx(whole.loss, abs=1e-6)
    for name, g in g_whole.items():
        torch.testing.assert_close(g_shared[name], g, atol=1e-6, rtol=1e-4, msg=name)
