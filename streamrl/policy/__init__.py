"""Policy backends: ``scripted`` (instant, deterministic), ``hf`` (transformers in-process),
``openai`` (any OpenAI-compatible server, vLLM first)."""

from __future__ import annotations

from typing import Any, get_args

from streamrl.config import Backend, PolicyConfig
from streamrl.envs.base import Environment
from streamrl.policy.base import Policy, PolicyError, PolicyRequest

_BACKENDS = get_args(Backend)


def make_policy(config: PolicyConfig, env: Environment, **kw: Any) -> Policy:
    """Build the configured backend. ``kw`` (``redis_url``, ``run``) reaches the backends that
    watch the run's ``policy`` stream for new weights; ``scripted`` ignores it."""
    env_for = kw.pop("env_for", None)
    worker = kw.pop("worker", "")  # the rollout worker's name: its server (base_url a list)
    if config.backend == "scripted":
        from streamrl.policy.scripted import ScriptedPolicy

        return ScriptedPolicy(config, env, env_for=env_for)
    if config.backend == "hf":
        from streamrl.policy.hf import HFPolicy

        return HFPolicy(config, env, **kw)
    if config.backend == "openai":
        from streamrl.policy.openai import OpenAIPolicy

        return OpenAIPolicy(config, env, worker=worker, **kw)
    raise ValueError(f"unknown policy backend {config.backend!r} (known: {', '.join(_BACKENDS)})")


def check_policy(config: PolicyConfig) -> None:
    """What can be checked of a backend without loading it, so ``produce`` refuses a run whose
    leases would only fail: ValueError (or ModelNotFound) saying what is missing."""
    from urllib.parse import urlparse

    if config.backend == "hf":
        from streamrl.models.local import require_model_dir

        require_model_dir(config.model, "policy.model")
    elif config.backend == "openai":
        urls = [config.base_url] if isinstance(config.base_url, str) else config.base_url
        for given in urls or [""]:
            url = urlparse(given)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ValueError(
                    f"policy.base_url = {config.base_url!r}: the openai backend needs the "
                    "server's http(s) URL (or a list of them), e.g. http://127.0.0.1:8000/v1"
                )
        if not config.model:
            raise ValueError("policy.model is empty: the openai backend needs the served model")


__all__ = ["Policy", "PolicyError", "PolicyRequest", "check_policy", "make_policy"]
