"""GRPO-family losses as small pure torch functions, with TRL 1.16's names and exact formulas.

Notation, for a batch of B completions (sequences) padded to T tokens:

- ``logps``          log π_θ(y_t | ·): the policy being trained, with gradient, (B, T)
- ``old_logps``      log π_old: the policy the PPO ratio is taken against (TRL's
                     ``old_per_token_logps``; the learner's own weights before the step), (B, T)
- ``behaviour_logps`` log μ: what the sampler reported when it generated the token (TRL's
                     ``sampling_per_token_logps``, vLLM's logprobs), (B, T); NaN where unknown
- ``mask``           1 for generated tokens that carry loss, 0 for prompt/padding, (B, T)
- ``advantages``     one per sequence, (B,) or (B, 1)

The loss of one token, as in TRL's ``GRPOTrainer._compute_loss``::

    r_t   = exp(logps - old_logps)                               PPO ratio
    ℓ_t   = -min(r_t·A, clip(r_t, 1-ε_low, 1+ε_high)·A)          clipped surrogate
    ℓ_t  *= w_t                                                 importance weight π_old/μ
    ℓ_t  += β · k3_t                                            KL to a reference model

and the batch loss is ``aggregate_loss`` of ℓ with TRL's ``loss_type``.
"""

from __future__ import annotations

import math
from typing import Literal

import msgspec
import torch
from torch import Tensor

LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSampling = Literal[
    "off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
]
LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo", "bnpo")
SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
IMPORTANCE_SAMPLING: tuple[str, ...] = (
    "off", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
)  # fmt: skip


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Unbiased (Bessel-corrected) standard deviation ignoring NaNs; NaN for fewer than 2
    values. Same as ``trl.trainer.utils.nanstd``."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(var, math.nan))
    std = torch.sqrt(var * correction)
    return std if keepdim or dim is None else std.squeeze(dim)


def group_advantages(
    rewards: Tensor, scale_rewards: ScaleRewards = "group", eps: float = 1e-4
) -> Tensor:
    """Group-relative advantages; TRL's ``scale_rewards`` (with ``sum_then_normalize``).

    ``rewards`` is (G, K): G groups of K samples; pad shorter groups with NaN (their
    advantages come back NaN). With μ_g the group's mean and σ the unbiased std::

        "group":  A_gk = (r_gk - μ_g) / (σ(r_g·) + eps)      GRPO (DeepSeekMath), TRL default
        "batch":  A_gk = (r_gk - μ_g) / (σ(r_··) + eps)      PPO-Lite: one std for the batch
        "none":   A_gk =  r_gk - μ_g                         Dr. GRPO: no std scaling

    ``eps`` is TRL's 1e-4.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    centred = rewards - torch.nanmean(rewards, dim=1, keepdim=True)
    if scale_rewards == "none":
        return centred
    std = nanstd(rewards, dim=1, keepdim=True) if scale_rewards == "group" else nanstd(rewards)
    return centred / (std + eps)


def _at_least_float32(x: Tensor) -> Tensor:
    """Half-precision logits are widened to float32 for the softmax; float64 stays float64."""
    return x if x.dtype == torch.float64 else x.float()


def token_logps(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[token]: the log-probability of each token under the
    sampling distribution at ``temperature`` (TRL divides the logits by ``args.temperature``
    the same way, so that they compare with the sampler's log-probs)."""
    if temperature != 1.0:
        logits = logits / temperature
    logits = _at_least_float32(logits)
    picked = torch.gather(logits, -1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: Tensor, mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the sampling distribution (softmax of logits / temperature) at each position
    where ``mask`` is set, as a flat (N,) tensor: only those rows of the (B, T, V) logits are
    expanded, which matters with a large vocabulary."""
    return row_entropy(logits[mask.bool()], temperature)


def row_entropy(rows: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of each row of (N, V) logits at ``temperature``: (N,)."""
    if temperature != 1.0:
        rows = rows / temperature
    logp = torch.log_softmax(_at_least_float32(rows), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def adapt_entropy_coef(
    coef: float, entropy: float, target: float, step: float, maximum: float
) -> float:
    """Adaptive entropy control (Skywork-OR1, He et al. 2025, section 4): the bonus coefficient
    follows the policy's entropy toward a target instead of being fixed::

        c_{k+1} = clip(c_k + Δ, 0, c_max)   if H_k < H_target
        c_{k+1} = clip(c_k - Δ, 0, c_max)   otherwise

    A fixed coefficient is either too weak to stop a collapse at a high learning rate or
    strong enough to hold the entropy up when the task wants a confident policy; this one is
    zero while the entropy is above the target and grows only as long as it stays below."""
    coef = coef + step if entropy < target else coef - step
    return min(maximum, max(0.0, coef))


def clipped_surrogate(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    delta: float | None = None,
) -> Tensor:
    """Per-token PPO clipped surrogate, negated (a loss); TRL ``epsilon``/``epsilon_high``/
    ``delta`` with ``importance_sampling_level="token"``::

        r = exp(logps - old_logps)
        ℓ = -min(min(r, δ)·A, clip(r, 1-ε_low, 1+ε_high)·A)

    δ (INTELLECT-2's two-sided clip) is off when None. DAPO's clip-higher: ε_high = 0.28.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    ratio = torch.exp(logps - old_logps)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    return -torch.min(ratio * advantages, clipped * advantages)


@torch.no_grad()
def importance_weights(
    old_logps: Tensor,
    behaviour_logps: Tensor,
    mask: Tensor,
    mode: ImportanceSampling = "token_truncate",
    clip_max: float | None = 2.0,
    clip_min: float | None = None,
) -> Tensor:
    """Importance weights π_old/μ correcting for tokens sampled by another policy μ (a stale
    policy version, or an inference engine whose numerics differ); no gradient. TRL's
    ``vllm_importance_sampling_mode`` / ``_clip_max`` (C) / ``_clip_min`` (c)::

        d_t = (old_logps_t - behaviour_logps_t)·mask_t     (NaN, i.e. unknown μ, → 0)
        token_truncate:     w_t = clamp(exp(d_t), c, C)            TIS (Yao et al. 2025)
        token_mask:         w_t = exp(d_t) if c ≤ exp(d_t) ≤ C else 0
        sequence_truncate:  w_i = clamp(exp(Σ_t d_t), c, C)        one weight per sequence
        sequence_mask:      w_i = exp(Σ_t d_t) if c ≤ · ≤ C else 0  (MIS)
        off:                w = 1

    Returns (B, T) for token modes, (B, 1) for sequence modes (broadcasts over tokens).
    """
    if mode not in IMPORTANCE_SAMPLING:
        raise ValueError(f"importance sampling must be one of {IMPORTANCE_SAMPLING}, got {mode!r}")
    if mode == "off":
        return torch.ones_like(old_logps)
    diff = torch.nan_to_num((old_logps - behaviour_logps) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def kl_k3(logps: Tensor, ref_logps: Tensor) -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate, Schulman's k3 (TRL ``beta`` > 0)::

    k3 = exp(ref - logp) - (ref - logp) - 1   ≥ 0
    """
    d = ref_logps - logps
    return torch.exp(d) - d - 1


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    loss_type: LossType = "dapo",
    *,
    max_completion_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | Tensor | None = None,
    num_chunks: int = 1,
) -> Tensor:
    """Reduce per-token losses to a scalar, TRL's ``loss_type``. With ℓ masked by ``mask``::

        grpo:     1/N_seq · Σ_i (Σ_t ℓ_it / max(1, |y_i|))    sequence mean, then mean (GRPO)
        dr_grpo:  Σ_it ℓ_it / (N_seq · L_max)                  L_max = max_completion_length
        dapo:     Σ_it ℓ_it / max(1, N_tok)                    tokens of the whole batch
        bnpo:     Σ_it ℓ_it / max(1, Σ_it mask_it) / num_chunks   tokens of this chunk only

    A batch processed in chunks (gradient accumulation) calls this once per chunk, giving
    ``num_sequences``/``num_tokens`` of the *whole* batch and ``num_chunks``; the chunk
    results sum to the batch loss, as TRL's micro-batches do (TRL's ``num_items_in_batch`` is
    N_tok). Defaults describe a batch that is a single chunk; then ``bnpo`` equals ``dapo``
    (in TRL they differ only under gradient accumulation or several processes).
    """
    masked = per_token_loss * mask
    n_seq = per_token_loss.size(0) if num_sequences is None else num_sequences
    if loss_type == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / n_seq
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        return masked.sum() / (n_seq * max_completion_length)
    if loss_type == "dapo":
        n_tok = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens)
        return masked.sum() / n_tok.clamp(min=1.0)
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0) / num_chunks
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


class LossConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The loss settings ``policy_loss`` takes, fixed for a run. The learner builds it from its
    ``[learner]`` table (``LearnerConfig.loss_config``); TRL's names are in brackets.

    ``importance_sampling`` (``vllm_importance_sampling_mode``), ``importance_sampling_max``/
    ``_min`` (C, c: ``..._clip_max``/``_clip_min``), ``epsilon_low``/``epsilon_high`` (ε:
    ``epsilon``/``epsilon_high``), ``delta`` (δ), ``beta`` (β), ``kl_bias_correction``
    (``use_bias_correction_kl``), ``loss_type`` and ``max_completion_length`` (dr_grpo's L_max).
    """

    importance_sampling: ImportanceSampling = "off"
    importance_sampling_max: float | None = 2.0
    importance_sampling_min: float | None = None
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    kl_bias_correction: bool = True
    loss_type: LossType = "dapo"
    max_completion_length: int | None = None


def policy_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: LossConfig,
    *,
    behaviour_logps: Tensor | None = None,
    ref_logps: Tensor | None = None,
    num_sequences: int | None = None,
    num_tokens: float | Tensor | None = None,
    num_chunks: int = 1,
) -> Tensor:
    """The whole GRPO-family loss of one chunk, composed in TRL's order::

        ℓ = clipped_surrogate(logps, old_logps, A) · importance_weights(old, μ)
            + β · k3(logps, ref) · (r if kl_bias_correction)
        L = aggregate_loss(ℓ)

    ``kl_bias_correction`` is TRL's ``use_bias_correction_kl`` (default True): the k3 term is
    multiplied by the PPO ratio r (value 1 on-policy, but it changes the gradient).
    ``num_sequences``/``num_tokens``/``num_chunks`` describe the whole batch (see
    ``aggregate_loss``); ``behaviour_logps`` (μ) and ``ref_logps`` are needed only when
    ``cfg`` turns importance sampling or the KL term on.
    """
    per_token = clipped_surrogate(
        logps, old_logps, advantages, cfg.epsilon_low, cfg.epsilon_high, cfg.delta
    )
    if cfg.importance_sampling != "off":
        if behaviour_logps is None:
            raise ValueError(
                f"importance_sampling={cfg.importance_sampling!r} needs behaviour_logps"
            )
        per_token = per_token * importance_weights(
            old_logps,
            behaviour_logps,
            mask,
            cfg.importance_sampling,
            cfg.importance_sampling_max,
            cfg.importance_sampling_min,
        )
    if cfg.beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta != 0 needs ref_logps")
        kl = kl_k3(logps, ref_logps)
        if cfg.kl_bias_correction:
            kl = kl * torch.exp(logps - old_logps)
        per_token = per_token + cfg.beta * kl
    return aggregate_loss(
        per_token,
        mask,
        cfg.loss_type,
        max_completion_length=cfg.max_completion_length,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
        num_chunks=num_chunks,
    )
