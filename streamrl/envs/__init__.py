"""Environments: tools, per-session state, multi-turn replies; see ``base.Environment``."""

from streamrl.envs.base import (
    Environment,
    EnvUnavailable,
    Prompt,
    ReplyResult,
    SampleMasked,
    StepResult,
    ToolError,
    Verdict,
    last_assistant_text,
    perturb_answer,
    user,
)
from streamrl.envs.registry import available, env_class, make_env

__all__ = [
    "EnvUnavailable",
    "Environment",
    "Prompt",
    "ReplyResult",
    "SampleMasked",
    "StepResult",
    "ToolError",
    "Verdict",
    "available",
    "env_class",
    "last_assistant_text",
    "make_env",
    "perturb_answer",
    "user",
]
