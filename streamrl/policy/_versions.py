"""Reading the run's ``policy`` stream: the learner XADDs one ``PolicyVersion`` per published
checkpoint (field ``p``), so the newest version is simply the stream's last entry."""

from __future__ import annotations

from typing import Any

from streamrl.bus.keys import Keys
from streamrl.schema import POLICY_VERSION, PolicyVersion, check_version


async def latest_version(client: Any, keys: Keys, lag: int = 0) -> PolicyVersion | None:
    """The last announced version (XREVRANGE ... COUNT 1 on an asyncio client), or None.
    ``lag`` > 0 picks the version announced ``lag`` announcements earlier (the oldest one while
    fewer exist): a deliberately stale policy, for off-policy experiments."""
    entries = await client.xrevrange(keys.policy, "+", "-", count=lag + 1)
    if not entries:
        return None
    _, fields = entries[-1]
    raw = fields.get(b"p", fields.get("p"))
    if raw is None:
        return None
    return check_version(POLICY_VERSION.decode(raw))
