"""The numbers of ``streamrl eval``: pass@k per prompt, its mean, and bootstrap intervals.

A sample *passes* when its reward is at least ``pass_reward`` (default the environment's
``max_reward``; 1e-9 of slack for float noise). With *n = k* samples per prompt of which *c*
pass, pass@k of one prompt is the unbiased estimator of Chen et al. 2021,
``1 - C(n-c, k) / C(n, k)``, and the reported pass@k is its mean over prompts, for k = 1, 2, 4,
... up to K (and K itself). pass@1 is the mean over prompts of c / n, all samples drawn at the
sampling temperature (at temperature 0 every sample of a prompt is the same, so
pass@k = pass@1). The 95% confidence intervals are percentile bootstrap intervals over prompts:
prompts are resampled with replacement (10,000 times, seeded) and the mean of their per-prompt
estimates recomputed, so the interval reflects both which prompts were drawn and the sampling
noise within each prompt (which the per-prompt estimates carry). They are exact to the
resampling, not to an assumption of normality; with one prompt, or when every prompt has the
same estimate, the interval has width 0.
"""

from __future__ import annotations

import math

import msgspec

_BOOTSTRAP_RESAMPLES = 10_000
CI_METHOD = "95% percentile bootstrap over prompts (10000 resamples)"
_EPS = 1e-9


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. 2021: the probability that at least one of ``k`` samples drawn without
    replacement from ``n`` samples, ``c`` of them correct, is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(samples: int) -> list[int]:
    """1, 2, 4, ... up to ``samples``, and ``samples`` itself."""
    ks = [1 << i for i in range(samples.bit_length()) if 1 << i <= samples]
    return ks if ks[-1] == samples else [*ks, samples]


def bootstrap_ci(
    values: list[float], seed: int = 0, resamples: int = _BOOTSTRAP_RESAMPLES
) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``values`` (one value per prompt)."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return (math.nan, math.nan)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    chunk = max(1, 2_000_000 // v.size)  # bound the index matrix to ~16 MB
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        idx = rng.integers(0, v.size, size=(stop - start, v.size))
        means[start:stop] = v[idx].mean(axis=1)
    lo, hi = np.quantile(means, [0.025, 0.975])
    return (float(lo), float(hi))


class PromptResult(msgspec.Struct, kw_only=True):
    prompt_id: str
    samples: int
    passed: int
    mean_reward: float


class Summary(msgspec.Struct, kw_only=True):
    """What the samples' rewards say, before the report adds how they were drawn."""

    mean_reward: float
    pass_at_1: float
    pass_at_1_ci: tuple[float, float]
    pass_at_k: dict[int, float]
    pass_at_k_ci: dict[int, tuple[float, float]]
    per_prompt: list[PromptResult]


def summarize(results: list[tuple[str, list[float]]], pass_reward: float, seed: int = 0) -> Summary:
    """The report's numbers from each prompt's rewards (every prompt with the same count)."""
    k_max = len(results[0][1])
    ks = ks_for(k_max)
    passes = [sum(r >= pass_reward - _EPS for r in rewards) for _, rewards in results]
    per_k = {k: [pass_at_k(k_max, c, k) for c in passes] for k in ks}
    value = {k: sum(v) / len(v) for k, v in per_k.items()}
    ci = {k: bootstrap_ci(v, seed) for k, v in per_k.items()}
    rewards = [r for _, rs in results for r in rs]
    return Summary(
        mean_reward=sum(rewards) / len(rewards),
        pass_at_1=value[1],
        pass_at_1_ci=ci[1],
        pass_at_k=value,
        pass_at_k_ci=ci,
        per_prompt=[
            PromptResult(prompt_id=pid, samples=len(rs), passed=c, mean_reward=sum(rs) / len(rs))
            for (pid, rs), c in zip(results, passes, strict=True)
        ],
    )
