"""Where the Redis URLs come from, and clients configured for long blocking stream reads.

Two Redis roles. The *data* Redis holds a run's streams and keys (``--redis``,
``STREAMRL_REDIS_URL``); it may be a Redis Cluster, named by the ``redis+cluster://`` (or
``rediss+cluster://``) scheme with any one node's address, and is then reached with redis-py's
``RedisCluster``. The *control* Redis holds rq's queues, jobs and worker registrations
(``--control-redis``, ``STREAMRL_CONTROL_URL``); rq does not support Redis Cluster, so it must
be a plain Redis, and defaults to the data Redis when that one is plain.

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

_ENV_URL = "STREAMRL_REDIS_URL"
_ENV_CONTROL_URL = "STREAMRL_CONTROL_URL"
# set by `streamrl worker` and WorkerProcs for rq workers whose data Redis is not rq's own
ENV_DATA_URL = "STREAMRL_DATA_URL"
_CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
_URL_SCHEMES = ("redis://", "rediss://", "unix://", *_CLUSTER_SCHEMES)
_PASSWORD = re.compile(r"(\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)[^@\s]+@", re.IGNORECASE)


def redact(text: str) -> str:
    """``text`` with the password of every URL in it masked: no message or log shows one."""
    return _PASSWORD.sub(r"\1***@", text)


def check_url(url: str) -> str:
    """``url`` if it is a Redis URL, else a ValueError that says what one looks like."""
    if not url.startswith(_URL_SCHEMES):
        hint = f" (did you mean redis://{redact(url)} ?)" if "://" not in url else ""
        raise ValueError(
            f"{redact(url)!r} is not a Redis URL: it must start with redis://, rediss://, "
            f"unix:// or (a Redis Cluster) redis+cluster://{hint}"
        )
    return url


def _is_cluster_url(url: str) -> bool:
    return url.startswith(_CLUSTER_SCHEMES)


def is_cluster(client: Any) -> bool:
    return isinstance(client, redis.RedisCluster | redis.asyncio.RedisCluster)


def _plain_url(url: str) -> str:
    """``redis+cluster://h:p`` -> ``redis://h:p``: what ``RedisCluster.from_url`` reads."""
    scheme, rest = url.split("://", 1)
    return f"{scheme.replace('+cluster', '')}://{rest}"


def control_url(data_url: str, control: str | None = None) -> str:
    """The plain Redis for rq: ``control``, else ``STREAMRL_CONTROL_URL``, else the data
    Redis itself when it is not a cluster."""
    url = control or os.environ.get(_ENV_CONTROL_URL)
    if url:
        check_url(url)
        if _is_cluster_url(url):
            raise ValueError(
                f"{redact(url)!r}: rq cannot use a Redis Cluster; give the control Redis as a "
                "plain redis:// URL"
            )
        return url
    if _is_cluster_url(data_url):
        raise ValueError(
            f"the data Redis {redact(data_url)!r} is a Redis Cluster, which rq cannot use: give "
            f"a plain Redis for rq's queues with --control-redis URL or {_ENV_CONTROL_URL}"
        )
    return data_url


_RETRY_ON = (redis.ConnectionError, redis.TimeoutError)


def _running_embedded_url(run_dir: str | Path = RUN_DIR) -> str | None:
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
    return url or os.environ.get(_ENV_URL) or _running_embedded_url(run_dir)


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=RECONNECT_CAP_S, base=RECONNECT_BASE_S)


def _sync_retry() -> Retry:
    return Retry(_backoff(), RECONNECT_RETRIES, supported_errors=_RETRY_ON)


def async_retry() -> redis.asyncio.retry.Retry:
    return redis.asyncio.retry.Retry(_backoff(), RECONNECT_RETRIES, supported_errors=_RETRY_ON)


def make_resilient(client: redis.Redis) -> redis.Redis:
    """Give an existing client (rq's, built from its CLI flags) the reconnecting retry."""
    client.set_retry(_sync_retry())
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
        kw["retry"] = async_retry() if asynchronous else _sync_retry()
    return kw


def _cluster_kwargs(resilient: bool, asynchronous: bool) -> dict[str, Any]:
    kw = _client_kwargs(resilient, asynchronous)
    kw.pop("health_check_interval", None)
    return kw


def connect(url: str, resilient: bool = False) -> Any:
    """A sync client: ``redis.Redis``, or ``redis.RedisCluster`` for a cluster URL (same
    commands; every Lua script streamrl runs touches keys of one hash slot)."""
    if _is_cluster_url(url):
        return redis.RedisCluster.from_url(
            _plain_url(url), **_cluster_kwargs(resilient, asynchronous=False)
        )
    return redis.Redis.from_url(url, **_client_kwargs(resilient, asynchronous=False))


def connect_async(url: str, resilient: bool = False) -> Any:
    if _is_cluster_url(url):
        return redis.asyncio.RedisCluster.from_url(
            _plain_url(url), **_cluster_kwargs(resilient, asynchronous=True)
        )
    return redis.asyncio.Redis.from_url(url, **_client_kwargs(resilient, asynchronous=True))
