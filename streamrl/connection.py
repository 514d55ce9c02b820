"""Where the Redis URL comes from, and clients configured for long blocking stream reads.

Long-lived roles (rq workers and their leases, the learner, the producer) use
``resilient=True``: every command is retried with exponential backoff on connection errors, so
a ``redis-server`` that is killed and restarted (with its AOF) is ridden out rather than
crashing the process. Retrying is safe because every write that matters is a fenced or
de-duplicating Lua script, a re-sent XREADGROUP only leaves entries in the reader's own pending
list (reclaimed later), and the producer pushes with a compare-and-set. One-shot commands
(``status``, ``dead``) fail fast instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from streamrl.defaults import (
    RECONNECT_BASE_S,
    RECONNECT_CAP_S,
    RECONNECT_RETRIES,
    RUN_DIR,
    SOCKET_TIMEOUT_S,
)

ENV_URL = "STREAMRL_REDIS_URL"
URL_SCHEMES = ("redis://", "rediss://", "unix://")
_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s]+@", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the password of every URL in it masked: no message or log shows one."""
    return _PASSWORD.sub(r"\1***@", text)


def check_url(url: str) -> str:
    """``url`` if it is a Redis URL, else a ValueError that says what one looks like."""
    if not url.startswith(URL_SCHEMES):
        hint = f" (did you mean redis://{redact(url)} ?)" if "://" not in url else ""
        raise ValueError(
            f"{redact(url)!r} is not a Redis URL: it must start with redis://, rediss:// or "
            f"unix://{hint}"
        )
    return url


_RETRY_ON = (redis.ConnectionError, redis.TimeoutError)


def running_embedded_url(run_dir: str | Path = RUN_DIR) -> str | None:
    """The URL of a server started by ``streamrl up`` in this directory, if it still answers."""
    path = Path(run_dir) / "redis.url"
    if not path.exists():
        return None
    url = path.read_text().strip()
    try:
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        return None
    return url


def resolve_url(url: str | None, run_dir: str | Path = RUN_DIR) -> str | None:
    return url or os.environ.get(ENV_URL) or running_embedded_url(run_dir)


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=RECONNECT_CAP_S, base=RECONNECT_BASE_S)


def sync_retry() -> Retry:
    return Retry(_backoff(), RECONNECT_RETRIES, supported_errors=_RETRY_ON)


def async_retry() -> redis.asyncio.retry.Retry:
    return redis.asyncio.retry.Retry(_backoff(), RECONNECT_RETRIES, supported_errors=_RETRY_ON)


def make_resilient(client: redis.Redis) -> redis.Redis:
    """Give an existing client (rq's, built from its CLI flags) the reconnecting retry."""
    client.set_retry(sync_retry())
    return client


def _client_kwargs(resilient: bool, asynchronous: bool) -> dict[str, Any]:
    # keep the socket timeout well above any BLOCK we issue so that a blocking read is never
    # cut and re-sent by the client.
    kw: dict[str, Any] = {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": 5,
        "health_check_interval": 30,
    }
    if resilient:
        kw["retry"] = async_retry() if asynchronous else sync_retry()
    return kw


def connect(url: str, resilient: bool = False) -> redis.Redis:
    return redis.Redis.from_url(url, **_client_kwargs(resilient, asynchronous=False))


def connect_async(url: str, resilient: bool = False) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(url, **_client_kwargs(resilient, asynchronous=True))
