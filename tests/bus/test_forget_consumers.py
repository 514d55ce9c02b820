"""Killed workers leave their consumer names behind; only those holding nothing are forgotten."""

from __future__ import annotations

import time

from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.bus.trim import forget_idle_consumers


def test_forgets_idle_empty_consumers_and_keeps_holders(r, run_name):
    keys = Keys(run_name)
    ensure_groups(r, keys)
    r.xadd(keys.tasks, {"p": b"x"})
    r.xreadgroup("rollout", "holder", {keys.tasks: ">"})  # holds one pending entry
    r.xgroup_createconsumer(keys.tasks, "rollout", "dead-and-empty")
    time.sleep(0.05)
    assert forget_idle_consumers(r, run_name, idle_ms=10) == 1
    names = {c["name"] for c in r.xinfo_consumers(keys.tasks, "rollout")}
    assert names == {b"holder"}
    assert r.xpending(keys.tasks, "rollout")["pending"] == 1
    # a consumer younger than the idle limit stays
    r.xgroup_createconsumer(keys.tasks, "rollout", "fresh")
    assert forget_idle_consumers(r, run_name, idle_ms=60_000) == 0
