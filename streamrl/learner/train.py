"""One optimizer step on one batch: forward/backward in micro-batches, clip, AdamW, schedule."""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from streamrl.learner.batch import Batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.logits import loss_start, masked_logps, sequence_logps
from streamrl.learner.losses import policy_loss
from streamrl.learner.mismatch import Mismatch, measure


@dataclass
class StepStats:
    loss: float
    grad_norm: float
    lr: float
    tokens: int
    sequences: int
    reward_mean: float
    entropy: float = 0.0  # mean token entropy of the policy on the batch's completions (nats)
    is_tokens: int = 0
    is_clipped: int = 0
    reward_std: float = 0.0  # population std of the batch's rewards
    is_weight_mean: float = 1.0  # importance weights π_old/μ of tokens with a known μ
    is_weight_min: float = 1.0
    is_weight_max: float = 1.0
    clip_low: float = 0.0  # fraction of completion tokens with ratio < 1-ε_low and A < 0
    clip_high: float = 0.0  # fraction with ratio > 1+ε_high and A > 0 (TRL's clip_ratio/*)
    seconds: float = 0.0  # wall time of the step (forward, backward, update)
    # sampler vs learner log-probs on the rows the current weights sampled (learner.mismatch)
    mismatch: Mismatch = field(default_factory=Mismatch)


@dataclass
class BatchLoss:
    loss: float
    entropy: float  # mean over the batch's completion tokens
    is_tokens: int = 0  # completion tokens with a known behaviour log-prob
    is_clipped: int = 0  # of those, how many had π_old/μ outside [min, max]
    is_weight_sum: float = 0.0  # Σ π_old/μ over those tokens
    is_weight_min: float = math.inf
    is_weight_max: float = -math.inf
    clipped_low: int = 0  # tokens where the PPO clip bound the ratio from below (A < 0)
    clipped_high: int = 0  # ... from above (A > 0), as TRL's clip_ratio/low_mean, high_mean
    mismatch: Mismatch = field(default_factory=Mismatch)


@dataclass
class ChunkLoss:
    value: Tensor  # the chunk's share of the batch loss, with its graph
    entropy: float  # sum of token entropies over the chunk's completion tokens
    is_tokens: int = 0
    is_clipped: int = 0
    is_weight_sum: float = 0.0
    is_weight_min: float = math.inf
    is_weight_max: float = -math.inf
    clipped_low: int = 0
    clipped_high: int = 0
    mismatch: Mismatch = field(default_factory=Mismatch)


def autocast(model: nn.Module, cfg: LearnerConfig) -> contextlib.AbstractContextManager:
    """The model forwards' mixed precision (``cfg.autocast``) on the model's device."""
    if cfg.autocast == "off":
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=getattr(torch, cfg.autocast))


def chunk_loss(
    model: nn.Module,
    batch: Batch,
    rows: slice,
    cfg: LearnerConfig,
    ref_model: nn.Module | None = None,
    num_chunks: int = 1,
) -> ChunkLoss:
    """The loss of ``batch[rows]``, normalised by the whole batch so that the chunks' losses
    sum to the batch loss (see ``batch_loss``)."""
    loss_cfg = cfg.loss_config()
    device = next(model.parameters()).device
    # positions before ``start`` carry no loss in any row: left out of every tensor below
    start = loss_start(batch.prompt_lens[rows] if batch.prompt_lens else None)
    ids = batch.input_ids[rows].to(device)
    attn = batch.attention_mask[rows].to(device)
    mask = batch.mask[rows, start:].to(device)
    behaviour = batch.behaviour_logps[rows, start:].to(device)
    prompt_lens = batch.prompt_lens[rows] if batch.prompt_lens and cfg.share_prompts else None
    with autocast(model, cfg):
        logps, entropies = masked_logps(
            model, ids, attn, mask, cfg.temperature, prompt_lens, start, cfg.entropy_coef > 0
        )
    entropy = entropies.sum()
    old = logps.detach()
    on_policy = batch.on_policy[rows] if batch.on_policy is not None else None
    mismatch = measure(old, behaviour, mask, on_policy)
    known = mask.bool() & ~torch.isnan(behaviour)
    ratio = torch.exp(old - torch.nan_to_num(behaviour))[known]
    lo, hi = loss_cfg.importance_sampling_min, loss_cfg.importance_sampling_max
    outside = (ratio > (math.inf if hi is None else hi)) | (ratio < (lo or 0.0))
    if cfg.clip_against == "behaviour":
        old = torch.where(torch.isnan(behaviour), old, behaviour)
    with torch.no_grad():  # where the clipped surrogate is the one taken (TRL's clip_ratio)
        ppo = torch.exp(logps.detach() - old)
        adv = batch.advantages[rows].to(device).reshape(-1, 1).expand_as(ppo)
        on = mask.bool()
        clipped_low = int(((ppo < 1 - loss_cfg.epsilon_low) & (adv < 0) & on).sum())
        clipped_high = int(((ppo > 1 + loss_cfg.epsilon_high) & (adv > 0) & on).sum())
    ref = None
    if loss_cfg.beta != 0.0:
        if ref_model is None:
            raise ValueError("beta != 0 needs a reference model")
        with torch.no_grad(), autocast(ref_model, cfg):
            ref = sequence_logps(ref_model, ids, attn, cfg.temperature, prompt_lens, start)
    loss = policy_loss(
        logps,
        old,
        batch.advantages[rows].to(device),
        mask,
        loss_cfg,
        behaviour_logps=behaviour,
        ref_logps=ref,
        num_sequences=batch.num_sequences,
        num_tokens=float(batch.num_tokens),
        num_chunks=num_chunks,
    )
    if cfg.entropy_coef > 0:
        loss = loss - cfg.entropy_coef * entropy / max(1, batch.num_tokens)
    return ChunkLoss(
        loss,
        float(entropy.detach()),
        int(known.sum()),
        int(outside.sum()),
        float(ratio.sum()) if ratio.numel() else 0.0,
        float(ratio.min()) if ratio.numel() else math.inf,
        float(ratio.max()) if ratio.numel() else -math.inf,
        clipped_low,
        clipped_high,
        mismatch,
    )


def batch_loss(
    model: nn.Module,
    batch: Batch,
    cfg: LearnerConfig,
    ref_model: nn.Module | None = None,
    backward: bool = True,
) -> BatchLoss:
    """The batch's loss (see ``losses.policy_loss``), computed in chunks of
    ``cfg.micro_batch_size`` sequences whose gradients accumulate into ``.grad``.

    The policy's mean token entropy is measured on every batch (a collapse to a deterministic
    policy shows there first); with ``entropy_coef > 0`` the loss also subtracts
    ``entropy_coef × mean entropy``, which keeps the policy sampling different completions, so
    its groups keep a reward spread to learn from. (Under adaptive entropy control the learner
    passes a ``cfg`` carrying this step's coefficient.)

    π_old is the model itself, detached (TRL with ``num_iterations=1``): the PPO ratio is 1 in
    value, and the off-policy correction is the importance weight π_θ/μ against the behaviour
    log-probs. With ``clip_against="behaviour"`` the ratio is taken against μ instead
    (PPO-style clipping against the sampler, as PipelineRL does); tokens with unknown μ then
    fall back to the detached model.
    """
    chunks = batch.chunks(cfg.micro_batch_size)
    out = BatchLoss(0.0, 0.0)
    entropy_sum = 0.0
    for rows in chunks:
        part = chunk_loss(model, batch, rows, cfg, ref_model, len(chunks))
        if backward:
            part.value.backward()
        out.loss += float(part.value.detach())
        entropy_sum += part.entropy
        add_chunk(out, part)
    out.entropy = entropy_sum / max(1, batch.num_tokens)
    return out


def add_chunk(out: BatchLoss, part: ChunkLoss) -> None:
    """Fold a chunk's importance-weight and clip counts into the batch's."""
    out.is_tokens += part.is_tokens
    out.is_clipped += part.is_clipped
    out.is_weight_sum += part.is_weight_sum
    out.is_weight_min = min(out.is_weight_min, part.is_weight_min)
    out.is_weight_max = max(out.is_weight_max, part.is_weight_max)
    out.clipped_low += part.clipped_low
    out.clipped_high += part.clipped_high
    out.mismatch.add(part.mismatch)


def lr_at(step: int, cfg: LearnerConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based): linear warmup over
    ``warmup_steps``, then constant, or linear/cosine decay to 0 at ``total_steps``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant" or cfg.total_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps))
    if cfg.lr_schedule == "linear":
        return cfg.lr * (1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, cfg: LearnerConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        # one kernel per parameter, the same on every run (bitwise reproducible on CPU), and
        # TRL's default (transformers' "adamw_torch_fused"); the per-tensor loop took ~15 % of
        # a SmolLM2-135M step on CPU (bench/learner_step.py)
        fused=True,
    )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: LearnerConfig,
    step: int,
    ref_model: nn.Module | None = None,
) -> StepStats:
    """Zero grads, accumulate the batch's gradient, clip, set the LR for ``step``, update."""
    started = time.perf_counter()
    model.train()
    optimizer.zero_grad(set_to_none=True)
    measured = batch_loss(model, batch, cfg, ref_model)
    return apply_update(optimizer, batch, cfg, step, measured, started)


def apply_update(
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: LearnerConfig,
    step: int,
    measured: BatchLoss,
    started: float,
) -> StepStats:
    """With the batch's gradient in ``.grad``: clip, set the LR for ``step``, update.
    ``measured``: the whole batch's loss and statistics (summed over ranks when data
    parallel); ``started``: when the step began (perf_counter), for its wall time."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if cfg.max_grad_norm > 0:
        total = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm, foreach=False)
    else:
        grads = [p.grad for p in params if p.grad is not None]
        total = torch.nn.utils.get_total_norm(grads, foreach=False) if grads else torch.zeros(())
    # under FSDP the norm is a DTensor, the same on every rank (reduced over the shards)
    norm = float(total.full_tensor() if isinstance(total, DTensor) else total)
    lr = lr_at(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rewards = batch.rewards
    mean = sum(rewards) / len(rewards) if rewards else 0.0
    std = math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)) if rewards else 0.0
    m, n = measured, max(1, batch.num_tokens)
    known = m.is_tokens > 0
    return StepStats(
        loss=m.loss,
        entropy=m.entropy,
        is_tokens=m.is_tokens,
        is_clipped=m.is_clipped,
        grad_norm=norm,
        lr=lr,
        tokens=batch.num_tokens,
        sequences=batch.num_sequences,
        reward_mean=mean,
        reward_std=std,
        is_weight_mean=m.is_weight_sum / m.is_tokens if known else 1.0,
        is_weight_min=m.is_weight_min if known else 1.0,
        is_weight_max=m.is_weight_max if known else 1.0,
        clip_low=m.clipped_low / n,
        clip_high=m.clipped_high / n,
        seconds=time.perf_counter() - started,
        mismatch=m.mismatch,
    )
