"""The key/value cache's name in transformers' model calls and outputs.

transformers 5.x renamed the forward's ``past_key_values`` argument and the output field to
``cache``; the old name warns on every call and goes in 5.40. ``pyproject.toml`` admits
transformers 4.56, which knows only the old name, so the name is read off the installed
release once (both changed together) instead of assumed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any


@functools.cache
def cache_name() -> str:
    """``cache`` where the installed transformers has it, else ``past_key_values``."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in fields else "past_key_values"


def with_cache(cache: Any) -> dict[str, Any]:
    """The keyword argument that hands ``cache`` to a model's forward."""
    return {cache_name(): cache}


def cache_of(out: Any) -> Any:
    """The cache a forward returned."""
    return getattr(out, cache_name())
