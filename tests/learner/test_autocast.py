"""``learner.autocast``: the forward's matmuls in bfloat16, the weights, gradients and AdamW
state in float32. The loss and gradients must stay close to the float32 step's (not equal:
bfloat16 is really used), and the update must land on float32 weights."""

from __future__ import annotations

import torch
from groupdata import make_groups

from streamrl.learner.batch import make_batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.train import batch_loss, make_optimizer, train_step
from streamrl.models.tiny import build_tokenizer


def _loss_and_grads(tiny_dir, autocast: str) -> tuple[float, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    model.train()
    cfg = LearnerConfig(model=str(tiny_dir), max_completion_length=4, autocast=autocast)
    batch = make_batch(make_groups(tiny_dir, 4, seed=2), build_tokenizer().pad_token_id, "group")
    model.zero_grad(set_to_none=True)
    loss = batch_loss(model, batch, cfg).loss
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_bfloat16_autocast_is_close_to_float32_and_keeps_float32_weights(tiny_dir):
    loss32, grads32 = _loss_and_grads(tiny_dir, "off")
    loss16, grads16 = _loss_and_grads(tiny_dir, "bfloat16")
    assert grads16.keys() == grads32.keys()
    assert all(g.dtype == torch.float32 for g in grads16.values())
    assert abs(loss16 - loss32) <= 0.02 * abs(loss32) + 1e-3
    flat32 = torch.cat([g.flatten() for g in grads32.values()])
    flat16 = torch.cat([g.flatten() for g in grads16.values()])
    cos = torch.nn.functional.cosine_similarity(flat32, flat16, dim=0).item()
    assert cos > 0.99, cos
    assert not torch.equal(flat32, flat16)  # the matmuls really ran in bfloat16

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = LearnerConfig(model=str(tiny_dir), max_completion_length=4, autocast="bfloat16",
                        lr=1e-5, warmup_steps=0)  # fmt: skip
    batch = make_batch(make_groups(tiny_dir, 4, seed=2), build_tokenizer().pad_token_id, "group")
    train_step(model, make_optimizer(model, cfg), batch, cfg, 0)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    # a 1e-5 step is below bfloat16's resolution for most weights: only float32 keeps it
    assert len(moved) > len(before) // 2, (len(moved), len(before))
