"""The loss functions on hand-computed numbers (TRL parity is in test_trl_parity.py)."""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.learner import losses
from streamrl.learner.config import LearnerConfig
from streamrl.learner.train import lr_at


def test_group_advantages_use_unbiased_std_and_nan_padding():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 1.0, math.nan, math.nan]])
    a = losses.group_advantages(r, "group")
    std0 = math.sqrt(4 * 0.25 / 3)  # Bessel: n - 1
    assert float(a[0, 0]) == pytest.approx(0.5 / (std0 + 1e-4))
    assert float(a[0, 1]) == pytest.approx(-0.5 / (std0 + 1e-4))
    std1 = math.sqrt(2 * 0.25**2 / 1)
    assert float(a[1, 1]) == pytest.approx(0.25 / (std1 + 1e-4))
    assert torch.isnan(a[1, 2:]).all()
    none = losses.group_advantages(r, "none")
    assert none[0].tolist() == [0.5, -0.5, -0.5, 0.5]
    batch = losses.group_advantages(r, "batch")
    std_all = float(losses.nanstd(r))
    assert float(batch[1, 0]) == pytest.approx(-0.25 / (std_all + 1e-4))


def test_clipped_surrogate():
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2, 1)
    lp = torch.full((2, 1), math.log(1.5))  # ratio 1.5
    loss = losses.clipped_surrogate(lp, old, adv, epsilon_low=0.2, epsilon_high=0.3)
    assert loss[:, 0].tolist() == pytest.approx([-1.3, 1.5])  # A>0 clipped at 1+ε_high
    lp = torch.full((2, 1), math.log(0.5))
    loss = losses.clipped_surrogate(lp, old, adv, 0.2, 0.3)
    assert loss[:, 0].tolist() == pytest.approx([-0.5, 0.8])  # A<0 clipped at 1-ε_low
    lp = torch.full((2, 1), math.log(4.0))
    loss = losses.clipped_surrogate(lp, old, adv, 0.2, 0.3, delta=2.0)
    assert loss[:, 0].tolist() == pytest.approx([-1.3, 2.0])  # two-sided clip caps A<0 at δ


def test_importance_weight_modes():
    old = torch.log(torch.tensor([[1.0, 1.0, 1.0, 1.0]]))
    beh = torch.log(torch.tensor([[2.0, 0.5, 0.1, math.nan]]))  # ratios 0.5, 2, 10, unknown
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    w = losses.importance_weights(old, beh, mask, "token_truncate", 3.0)
    assert w[0].tolist() == pytest.approx([0.5, 2.0, 3.0, 1.0])
    w = losses.importance_weights(old, beh, mask, "token_mask", 3.0, 0.6)
    assert w[0].tolist() == pytest.approx([0.0, 2.0, 0.0, 1.0])
    w = losses.importance_weights(old, beh, mask, "sequence_truncate", 3.0)
    assert w.shape == (1, 1) and float(w) == pytest.approx(3.0)  # 0.5·2·10 = 10 → 3
    w = losses.importance_weights(old, beh, mask, "sequence_mask", 20.0)
    assert float(w) == pytest.approx(10.0)
    assert float(losses.importance_weights(old, beh, mask, "sequence_mask", 3.0)) == 0.0
    assert losses.importance_weights(old, beh, mask, "off").tolist() == [[1.0] * 4]
    masked = losses.importance_weights(old, beh, torch.tensor([[1.0, 0, 0, 0]]), "token_mask", 3.0)
    assert masked[0].tolist() == pytest.approx([0.5, 1.0, 1.0, 1.0])  # padding: weight 1


def test_aggregation():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(losses.aggregate_loss(loss, mask, "grpo")) == pytest.approx((2.0 + 4.0) / 2)
    assert float(losses.aggregate_loss(loss, mask, "dapo")) == pytest.approx(10 / 4)
    assert float(losses.aggregate_loss(loss, mask, "bnpo")) == pytest.approx(10 / 4)
    dr = losses.aggregate_loss(loss, mask, "dr_grpo", max_completion_length=5)
    assert float(dr) == pytest.approx(10 / (2 * 5))
    # chunks of one batch sum to the batch loss
    parts = [
        losses.aggregate_loss(loss[i : i + 1], mask[i : i + 1], "dapo", num_tokens=4.0)
        for i in range(2)
    ]
    assert float(sum(parts)) == pytest.approx(10 / 4)
    with pytest.raises(ValueError):
        losses.aggregate_loss(loss, mask, "dr_grpo")


def test_kl_k3_is_zero_at_reference_and_positive_elsewhere():
    lp = torch.tensor([-1.0, -2.0])
    assert losses.kl_k3(lp, lp).tolist() == [0.0, 0.0]
    assert (losses.kl_k3(lp, lp + 0.3) > 0).all()


def test_lr_schedule():
    cfg = LearnerConfig(model="m", lr=1.0, warmup_steps=2, lr_schedule="cosine", total_steps=6)
    lrs = [lr_at(s, cfg) for s in range(7)]
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[4] == pytest.approx(0.5) and lrs[6] == pytest.approx(0.0)
    assert lr_at(100, LearnerConfig(model="m", lr=0.1)) == 0.1


def test_adaptive_entropy_coef_follows_the_entropy_toward_its_target():
    step = lambda c, h: losses.adapt_entropy_coef(c, h, target=0.5, step=0.01, maximum=0.03)  # noqa: E731
    c = 0.0
    for _ in range(5):  # below the target: up by one step each time, never past the maximum
        c = step(c, 0.1)
    assert c == pytest.approx(0.03)
    c = step(c, 0.9)  # above it: down again
    assert c == pytest.approx(0.02)
    assert step(0.0, 0.9) == 0.0  # and never below zero
    assert step(0.0, 0.5) == 0.0  # at the target counts as enough


def test_entropy_target_must_be_positive():
    import msgspec

    with pytest.raises(msgspec.ValidationError, match="entropy_target"):
        LearnerConfig(model="m", entropy_target=0.0)


def test_loss_config_carries_the_learner_settings_in_loss_names():
    cfg = LearnerConfig(model="m", epsilon=0.1, beta=0.3, use_bias_correction_kl=False)
    loss_cfg = cfg.loss_config()
    assert loss_cfg.epsilon_low == loss_cfg.epsilon_high == 0.1  # epsilon_high None → epsilon
    assert (loss_cfg.beta, loss_cfg.kl_bias_correction) == (0.3, False)
    assert loss_cfg.importance_sampling == "token_truncate" and loss_cfg.loss_type == "dapo"
    assert LearnerConfig(model="m", epsilon_high=0.28).loss_config().epsilon_high == 0.28
    with pytest.raises(AttributeError):
        loss_cfg.beta = 0.0  # type: ignore[misc]  # frozen: one run, one set of loss settings
