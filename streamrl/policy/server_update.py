"""How the ``openai`` backend's workers take turns updating a policy server (``sync``).

One worker at a time updates a server: it holds ``<served>:lock``, a token that expires after
``LOCK_MS`` and that its holder renews every third of that while the update runs. A holder
that dies (SIGKILL, a lost host) frees the server within ``LOCK_MS``; one that is cancelled
(its lease ended mid-swap) releases it on the way out.

The run's ``served`` hash for the server (``Keys.served``) holds, besides ``version`` and
``model`` (what the server serves, written by the worker that updated it):

- ``paused``: set by a worker between its ``/pause`` and its ``/resume``. A worker that finds
  it set and can take the lock (so its writer is gone) sends ``/resume`` itself: a worker
  killed mid-swap must not leave the server paused for every other worker.
- ``failed``, ``error``, ``failed_at``: the last version this server could not load, why and
  when (unix seconds). Every worker of the server reports that error in policy health, not
  only the one that tried, and none asks the server again for ``retry_s``: a version that
  cannot load must not pause the server on every check.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger(__name__)

LOCK_MS = 30_000

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


@dataclass(frozen=True)
class Served:
    """One read of a server's ``served`` hash."""

    version: int = 0
    model: str = ""
    paused: str | None = None
    failed: int | None = None
    error: str | None = None
    failed_at: float = 0.0

    @classmethod
    def parse(cls, raw: dict[bytes, bytes]) -> Served:
        def text(name: bytes) -> str | None:
            value = raw.get(name)
            return value.decode(errors="replace") if value is not None else None

        failed = text(b"failed")
        return cls(
            version=int(raw.get(b"version", 0)),
            model=text(b"model") or "",
            paused=text(b"paused"),
            failed=int(failed) if failed else None,
            error=text(b"error"),
            failed_at=float(raw.get(b"failed_at", 0.0)),
        )

    def failure(self, version: int, retry_s: float, now: float | None = None) -> str | None:
        """The error of a recent failed load of ``version`` on this server, else None."""
        now = time.time() if now is None else now
        if self.failed != version or self.error is None or now - self.failed_at >= retry_s:
            return None
        return self.error


async def read(r: Any, key: str) -> Served:
    return Served.parse(await r.hgetall(key))


async def mark_paused(r: Any, key: str, worker: str) -> None:
    """Set before ``/pause``, for another worker to resume the server if this one dies."""
    await r.hset(key, "paused", worker)


async def clear_paused(r: Any, key: str) -> None:
    """After ``/resume``."""
    await r.hdel(key, "paused")


async def record_failure(r: Any, key: str, version: int, error: str) -> None:
    await r.hset(key, mapping={"failed": version, "error": error, "failed_at": time.time()})


async def record_loaded(r: Any, key: str, version: int, model: str) -> None:
    """The server serves ``version``; an earlier failure no longer stands (left behind if
    this worker dies in between, it names an older version than any it could match)."""
    await r.hset(key, mapping={"version": version, "model": model})
    await r.hdel(key, "failed", "error", "failed_at")


@contextlib.asynccontextmanager
async def update_lock(r: Any, key: str, lock_ms: int = LOCK_MS) -> AsyncIterator[str | None]:
    """Yield a token while this worker holds the server's update lock, None when another
    worker holds it. The lock is renewed while held and released on exit, cancellation
    included (a second cancellation during the release leaves it to expire)."""
    lock, token = key + ":lock", uuid.uuid4().hex
    if not await r.set(lock, token, nx=True, px=lock_ms):
        yield None
        return
    renew = asyncio.create_task(_renew(r, lock, token, lock_ms))
    try:
        yield token
    finally:
        renew.cancel()
        await r.eval(_RELEASE, 1, lock, token)


async def _renew(r: Any, lock: str, token: str, lock_ms: int) -> None:
    while True:
        await asyncio.sleep(lock_ms / 3000)
        try:
            if not await r.eval(_RENEW, 1, lock, token, lock_ms):
                log.error("policy server update lock lost while updating", lock=lock)
                return
        except Exception as e:  # Redis trouble: the next renewal tries again
            log.warning("policy server update lock not renewed", lock=lock, error=repr(e))
