"""A rollout lease's staleness guard (rules in ``streamrl.bus.health``).

A lease loads its worker's record from its previous lease, then on every heartbeat asks the
backend to look for a newer policy and records the version it serves and its last reload error
in the run's ``policy_health`` hash. A worker more than ``max_staleness`` versions behind for
longer than ``rollout.max_policy_lag_s`` sets the run's fault and trips the guard (the lease
fails); it takes back the fault it raised once it is recent enough again.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from streamrl import schema
from streamrl.bus import health
from streamrl.bus.keys import Keys
from streamrl.config import RunConfig
from streamrl.policy import Policy
from streamrl.policy._versions import latest_version

log = structlog.get_logger("streamrl.rollout")

CLOSE_GRACE_S = 30.0  # a reload running at lease end: time to finish, then to clean up


class PolicyWatch:
    def __init__(self, r: Any, keys: Keys, worker: str, wake: asyncio.Event):
        """``wake`` is set when the guard trips (the lease loop may be waiting on it)."""
        self.r = r
        self.keys = keys
        self.worker = worker
        self.wake = wake
        self.record: schema.WorkerPolicy | None = None  # this worker's last policy record
        self.stale: str | None = None  # set when the guard trips: the lease fails
        self._refreshing: asyncio.Task | None = None

    async def load(self) -> None:
        """Pick up this worker's record from its previous lease (a worker already behind stays
        behind since then: leases are shorter than ``max_policy_lag_s``), and drop the records
        of workers that went quiet."""
        now = time.time()
        quiet = []
        for field, raw in (await self.r.hgetall(self.keys.policy_health)).items():
            record = health.decode(raw)
            if record is None or not health.is_fresh(record, now):
                quiet.append(field)
            elif record.worker == self.worker:
                self.record = record
        if quiet:
            await self.r.hdel(self.keys.policy_health, *quiet)

    async def check(self, policy: Policy, cfg: RunConfig) -> None:
        """Record the version this worker serves; trip the guard, or take back the fault this
        worker raised once it is recent enough again."""
        latest = await latest_version(self.r, self.keys)
        now = time.time()
        record = health.observe(
            self.record,
            worker=self.worker,
            backend=policy.name,
            version=policy.version,
            newest=latest.version if latest is not None else None,
            error=policy.reload_error,
            max_staleness=health.max_staleness(cfg),
            heartbeat_s=cfg.streams.heartbeat_s,
            now=now,
            server=policy.server,
            requests=policy.requests,
        )
        reason = health.stale_reason(record, cfg.rollout.max_policy_lag_s, now)
        if reason is not None:
            record.fault = f"PolicyStale: {reason}"
            await self.r.set(self.keys.fault, record.fault)
            self.stale = reason
            self.wake.set()
        elif record.behind_since is None and record.fault is not None:
            if await self.r.get(self.keys.fault) == record.fault.encode():
                await self.r.delete(self.keys.fault)
            record.fault = None
        self.record = record
        await self.r.hset(self.keys.policy_health, self.worker, schema.encode(record))

    async def heartbeat(self, policy: Policy, cfg: RunConfig) -> None:
        """Start a reload in the background (one at a time), then ``check``."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(policy.refresh())
        try:
            await self.check(policy, cfg)
        except Exception as e:  # Redis trouble: the next heartbeat tries again
            log.warning("policy health check failed", error=repr(e))

    async def aclose(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Let a reload that is running finish (a lease that ends mid-swap would otherwise
        leave the server paused and locked), then cancel it and wait for its clean-up."""
        task = self._refreshing
        if task is None or task.done():
            return
        await asyncio.wait({task}, timeout=grace_s)
        if not task.done():
            log.warning("policy reload still running at lease end; cancelled", grace_s=grace_s)
            task.cancel()
            await asyncio.wait({task}, timeout=grace_s)
