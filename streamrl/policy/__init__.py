"""Policy backends: ``scripted`` (instant, deterministic), ``hf`` (transformers in-process),
``openai`` (any OpenAI-compatible server, vLLM first)."""

from __future__ import annotations

from typing import Any, get_args

from streamrl.config import Backend, PolicyConfig
from streamrl.envs.base import Environment
from streamrl.policy.base import Policy, PolicyError, PolicyRequest

BACKENDS = get_args(Backend)


def make_policy(config: PolicyConfig, env: Environment, **kw: Any) -> Policy:
    """Build the configured backend. ``kw`` (``redis_url``, ``run``) reaches the backends that
    watch the run's ``policy`` stream for new weights; ``scripted`` ignores it."""
    env_for = kw.pop("env_for", None)
    if config.backend == "scripted":
        from streamrl.policy.scripted import ScriptedPolicy

        return ScriptedPolicy(config, env, env_for=env_for)
    if config.backend == "hf":
        from streamrl.policy.hf import HFPolicy

        return HFPolicy(config, env, **kw)
    if config.backend == "openai":
        from streamrl.policy.openai import OpenAIPolicy

        return OpenAIPolicy(config, env, **kw)
    raise ValueError(f"unknown policy backend {config.backend!r} (known: {', '.join(BACKENDS)})")


__all__ = ["Policy", "PolicyError", "PolicyRequest", "make_policy"]
