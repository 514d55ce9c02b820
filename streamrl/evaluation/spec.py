"""What ``evaluate`` is asked (``EvalSpec``) and what it answers (``EvalReport``).

The command builds one ``EvalSpec`` from its options and the run config; Python callers build
it directly. ``EvalReport`` is what ``streamrl eval --json`` prints, field for field.
"""

from __future__ import annotations

from typing import Any

import msgspec

from streamrl.config import RolloutConfig
from streamrl.evaluation.estimators import PromptResult

DEFAULT_PROMPTS = 200
DEFAULT_K = 8
DEFAULT_TRAIN_PROMPTS = 10_000


class EvalSpec(msgspec.Struct, frozen=True, kw_only=True):
    """One evaluation: ``k`` samples on each of ``prompts`` held-out prompts of ``env``."""

    env: str  # environment name or module:Class
    model: str  # local transformers model directory
    options: dict[str, Any] = {}  # the environment's options
    weights: str | None = None  # a published policy version loaded over ``model``
    prompts: int = DEFAULT_PROMPTS
    k: int = DEFAULT_K  # samples per prompt
    seed: int = 0  # the producer's seed: held-out prompts exclude its training prompts
    train_prompts: int = DEFAULT_TRAIN_PROMPTS  # ... 0 .. train_prompts-1
    temperature: float = 1.0
    max_new_tokens: int = 64
    max_turns: int | None = None  # None: ``rollout.max_turns``
    pass_reward: float | None = None  # None: the environment's ``max_reward``
    policy_options: dict[str, Any] = {}  # ``[policy] options`` of the run config
    rollout: RolloutConfig = msgspec.field(default_factory=RolloutConfig)


class EvalReport(msgspec.Struct, kw_only=True):
    env: str
    env_version: str
    options: dict[str, Any]
    model: str
    weights: str | None  # a published policy version loaded over the model
    policy_version: int | None  # its number, when the path says it (v<N>)
    seed: int
    prompts: int
    k: int  # samples per prompt
    samples: int
    temperature: float
    max_new_tokens: int
    max_turns: int
    pass_reward: float
    mean_reward: float
    pass_at_1: float
    pass_at_1_ci: tuple[float, float]
    pass_at_k: dict[int, float]
    pass_at_k_ci: dict[int, tuple[float, float]]
    ci_method: str
    truncated: int  # episodes stopped by max_turns or the token budget
    # samples whose score the environment masked, by kind; their prompts are left out
    masked: dict[str, int] = msgspec.field(default_factory=dict)
    turns_per_episode: float = 0.0  # model turns, mean over samples
    tool_calls_per_episode: float = 0.0  # the model's tool calls, mean over samples
    malformed_call_rate: float = 0.0  # of those calls, unknown tool or bad arguments
    train_prompts: int  # held out from training prompts 0 .. train_prompts-1 (by content)
    candidates: int  # held-out candidates generated to find `prompts` unseen ones
    excluded_seen: int
    excluded_duplicate: int
    generate_errors: int
    seconds: float  # all of it: held-out prompts, model load, episodes, verification
    rollout_seconds: float  # episodes and verification only
    samples_per_s: float  # samples / rollout_seconds
    per_prompt: list[PromptResult]
