"""How many shards a run has: its stored config says (``[streams] shards``)."""

from __future__ import annotations

from typing import Any

import msgspec

from streamrl.bus.keys import Keys, shard_keys


def shard_count(r: Any, run: str) -> int:
    """The run's shard count from its config; 1 when it has none yet (or an unreadable one:
    the leases that need it fail on it and say why)."""
    from streamrl.config import RUN_CONFIG

    raw = r.get(Keys(run).config)
    if not raw:
        return 1
    try:
        return RUN_CONFIG.decode(raw).streams.shards
    except (msgspec.DecodeError, msgspec.ValidationError):
        return 1


def run_shards(r: Any, run: str) -> list[Keys]:
    """The keys of every shard of the run (one ``Keys(run)`` when unsharded)."""
    return shard_keys(run, shard_count(r, run))


# what a lease logs as it ends at once for a shard its run does not have
NO_SUCH_SHARD = "the run has no such shard (the lease was queued before its shards were known)"


def keys_of_shard(run: str, shard: int | None, shards: int) -> Keys | None:
    """The keys of one shard (``None``: the unsharded run) of a run with ``shards`` shards,
    or None when the run has no such shard: a lease queued before the producer stored the
    run's shard count, say, which must not spend itself on streams nobody writes."""
    if shards == 1:
        return Keys(run) if shard is None else None
    if shard is None or not 0 <= shard < shards:
        return None
    return Keys(run, shard, shards)
