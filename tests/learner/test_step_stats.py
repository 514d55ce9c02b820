"""What the learner measures on every batch besides the loss: the policy's token entropy (and
the optional entropy bonus that keeps a policy from collapsing onto one completion per prompt),
and how many importance weights fell outside their bounds."""

from __future__ import annotations

import math

import pytest
import torch
from groupdata import make_groups

from streamrl.learner.batch import make_batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.losses import token_entropy
from streamrl.learner.train import batch_loss, make_optimizer, train_step
from streamrl.models.tiny import build_tokenizer


def test_token_entropy_of_known_distributions():
    vocab = 7
    uniform = torch.zeros(1, 2, vocab)
    peaked = torch.full((1, 2, vocab), -1e4)
    peaked[..., 3] = 0.0
    both = torch.cat([uniform, peaked])
    mask = torch.tensor([[1, 0], [1, 1]])
    h = token_entropy(both, mask)
    assert h.shape == (3,)  # only the masked positions
    assert h[0].item() == pytest.approx(math.log(vocab), rel=1e-6)
    assert h[1:].abs().max().item() < 1e-6
    # temperature flattens: at T=2 a two-level distribution has more entropy than at T=1
    two = torch.tensor([[[0.0, 2.0, 2.0]]])
    one_mask = torch.ones(1, 1)
    assert token_entropy(two, one_mask, 2.0) > token_entropy(two, one_mask, 1.0)


def _entropy_after_steps(tiny_dir, coef: float, steps: int = 5) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    cfg = LearnerConfig(model=str(tiny_dir), lr=5e-3, entropy_coef=coef, max_completion_length=4)
    batch = make_batch(make_groups(tiny_dir, 4, seed=1), build_tokenizer().pad_token_id, "group")
    opt = make_optimizer(model, cfg)
    first = batch_loss(model, batch, cfg, backward=False).entropy
    for step in range(steps):
        stats = train_step(model, opt, batch, cfg, step)
    return first, stats.entropy


def test_entropy_bonus_raises_the_policys_entropy(tiny_dir):
    start, plain = _entropy_after_steps(tiny_dir, 0.0)
    _, bonus = _entropy_after_steps(tiny_dir, 3.0)
    assert start > 0
    # fitting the same batch sharpens the policy; the bonus pulls the other way
    assert plain < start
    assert bonus > plain + 0.1, (start, plain, bonus)


def test_importance_weights_outside_their_bounds_are_counted(tiny_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    groups = make_groups(tiny_dir, 2, seed=3)
    pad = build_tokenizer().pad_token_id
    cfg = LearnerConfig(model=str(tiny_dir), importance_sampling_max=2.0, max_completion_length=4)
    near = batch_loss(model, make_batch(groups, pad, "group"), cfg, backward=False)
    assert near.is_tokens > 0 and near.is_clipped == 0  # μ = π ± 0.1 noise: ratios near 1
    for g in groups:  # a sampler that gave every token e^-2 of the probability: π/μ ≈ 7.4
        for s in g.samples:
            for t in s.trajectory.turns:
                t.logprobs = [lp - 2.0 for lp in t.logprobs]
    far = batch_loss(model, make_batch(groups, pad, "group"), cfg, backward=False)
    assert far.is_tokens == near.is_tokens and far.is_clipped == far.is_tokens
