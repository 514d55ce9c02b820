"""Training–inference mismatch: do the sampler and the learner compute the same log-probs?

For a token the sampler generated, it recorded the behaviour log-prob log μ(y_t); the learner
recomputes log π(y_t) on the same token ids. When the sampler served exactly the weights the
learner holds (the row's policy version is the learner's current one: staleness 0), any
difference is mismatch between the two engines (numerics, a different tokenization of a turn,
a sampling distribution the learner does not reproduce), not policy drift. With
Δ_t = log π(y_t) - log μ(y_t) over those tokens, a step reports (PipelineRL's and verl's
"training-inference mismatch")::

    mismatch_abs = mean_t |Δ_t|
    mismatch_kl  = mean_t (exp(Δ_t) - 1 - Δ_t)     k3 estimate of KL(μ ‖ π), ≥ 0
    mismatch_tokens = how many tokens it was measured on

A step without a single such token (every row stale, or the learner's weights are not a
published version because ``sync_every`` > 1) reports nothing, rather than a 0 that looks
like agreement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass
class Mismatch:
    """Sums over the measured tokens; chunks and ranks add up (``add``)."""

    tokens: int = 0
    abs_sum: float = 0.0
    k3_sum: float = 0.0

    def add(self, other: Mismatch) -> None:
        self.tokens += other.tokens
        self.abs_sum += other.abs_sum
        self.k3_sum += other.k3_sum

    def means(self) -> dict[str, float | int]:
        """``mismatch_abs``, ``mismatch_kl``, ``mismatch_tokens``; empty when unmeasured."""
        if not self.tokens:
            return {}
        return {
            "mismatch_abs": self.abs_sum / self.tokens,
            "mismatch_kl": self.k3_sum / self.tokens,
            "mismatch_tokens": self.tokens,
        }


@torch.no_grad()
def measure(logps: Tensor, behaviour: Tensor, mask: Tensor, on_policy: Tensor | None) -> Mismatch:
    """Over generated tokens (``mask``) with a known behaviour log-prob, of the rows where
    ``on_policy`` (B,) is set; ``on_policy`` None: no row is (nothing measured)."""
    if on_policy is None or not bool(on_policy.any()):
        return Mismatch()
    rows = on_policy.to(mask.device).bool().unsqueeze(1)
    known = mask.bool() & ~torch.isnan(behaviour) & rows
    delta = (logps.detach() - behaviour)[known].double()
    if not delta.numel():
        return Mismatch()
    k3 = torch.expm1(delta) - delta
    abs_sum, k3_sum = torch.stack([delta.abs().sum(), k3.sum()]).tolist()  # one device sync
    return Mismatch(int(delta.numel()), abs_sum, k3_sum)


def weights_version(step: int, policy_version: int, sync_every: int) -> int | None:
    """The published policy version the learner's weights are before optimizer step ``step``:
    ``policy_version`` right after a publish (every ``sync_every`` steps, and at the start),
    None between publishes (its weights have moved past every published version)."""
    return policy_version if step % max(1, sync_every) == 0 else None


class _Stats(Protocol):  # train._Stats, which imports this module
    lr: float
    grad_norm: float
    entropy: float
    mismatch: Mismatch


@dataclass
class StepLog:
    """The last step's figures for the learner's progress hash; the mismatch is the last
    measured one, with the step it was measured at (``mismatch_step``)."""

    last: _Stats | None = None
    measured: dict[str, float | int] | None = None

    def record(self, step: int, stats: _Stats) -> None:
        self.last = stats
        if means := stats.mismatch.means():
            self.measured = {**means, "mismatch_step": step}

    def fields(self) -> dict[str, str | int | float]:
        out: dict[str, str | int | float] = {}
        s = self.last
        if s is not None:
            out.update(lr=s.lr, grad_norm=s.grad_norm, entropy=round(s.entropy, 4))
        if self.measured:
            out.update(self.measured)
        return out
