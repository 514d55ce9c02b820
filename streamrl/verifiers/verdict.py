"""What a verifier returns: the contract between verifiers, environments and the verify worker."""

from __future__ import annotations

from typing import Any

import msgspec


class Verdict(msgspec.Struct, kw_only=True):
    """A verifier's answer before the worker stamps it into a Score."""

    reward: float
    components: dict[str, float] = msgspec.field(default_factory=dict)
    details: dict[str, str] = msgspec.field(default_factory=dict)
    info: dict[str, Any] = msgspec.field(default_factory=dict)  # other JSON the verifier kept
