"""Where the Redis URLs come from, and clients configured for long blocking stream reads.

Two Redis roles. The *data* Redis holds a run's streams and keys (``--redis``,
``STREAMRL_REDIS_URL``); it may be a Redis Cluster, named by the ``redis+cluster://`` (or
``rediss+cluster://``) scheme with any one node's address (or several), and is then reached
with redis-py's ``RedisCluster`` (``streamrl.retrying``). The *control* Redis holds rq's
queues, jobs and worker registrations (``--control-redis``, ``STREAMRL_CONTROL_URL``); rq does
not support Redis Cluster, so it must be a plain Redis, and defaults to the data Redis when
that one is plain.

A cluster URL may list several nodes, ``redis+cluster://h1:p1,h2:p2,h3:p3``: a client then
starts even while one of them is down (one is enough while it is up: the client learns the
others from it).

Long-lived roles (rq workers and their leases, the learner, the producer) use
``resilient=True``: every command is retried with exponential backoff on connection errors, so
a ``redis-server`` that is killed and restarted (with its AOF), or a Redis Cluster master whose
replica takes over, is ridden out rather than crashing the process (on a cluster through
``streamrl.retrying``: redis-py's own cluster retries do not pause). Retrying is safe because
every write that matters is a fenced or de-duplicating Lua script, a re-sent XREADGROUP only
leaves entries in the reader's own pending list (reclaimed later), and the producer pushes
with a compare-and-set. One-shot commands (``status``, ``dead``) check the URL with one PING
that fails fast, then retry for a shorter while (``BRIEF_RECONNECT_RETRIES``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from streamrl.defaults import RECONNECT_RETRIES, RUN_DIR, SOCKET_TIMEOUT_S
from streamrl.retrying import (
    RETRY_ON,
    PausingAsyncCluster,
    PausingCluster,
    async_retry,
    backoff,
    cluster_parts,
    cluster_retryable,
    patience_s,
    sync_retry,
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
    if _is_cluster_url(url):
        try:
            cluster_parts(url)
        except ValueError as e:
            raise ValueError(f"{redact(url)!r}: {e}") from None
    return url


def _is_cluster_url(url: str) -> bool:
    return url.startswith(_CLUSTER_SCHEMES)


def is_cluster(client: Any) -> bool:
    return isinstance(client, redis.RedisCluster | redis.asyncio.RedisCluster)


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


def make_resilient(client: Any, retries: int = RECONNECT_RETRIES) -> Any:
    """Give an existing client (rq's, built from its CLI flags; one ``connect`` made) the
    reconnecting retry."""
    client.set_retry(sync_retry(retries))
    return client


class ResilientRedis(redis.Redis):
    """rq's ``--connection-class`` for the workers streamrl starts (``procs.rq_worker_cmd``):
    rq's command line reads ``rq:suspended`` before it makes the worker class, so a worker
    started while Redis is down (or restarting) exited 1 there, before ``LeaseWorker`` could
    make its client resilient. With this class that first command waits too."""

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> ResilientRedis:
        return make_resilient(super().from_url(url, **kwargs))


def _cluster_kwargs() -> dict[str, Any]:
    """A cluster client's retry is set after it is made (``set_retry``), not passed."""
    kw = _client_kwargs(None, asynchronous=False)
    kw.pop("health_check_interval", None)
    return kw


def _client_kwargs(retries: int | None, asynchronous: bool) -> dict[str, Any]:
    # keep the socket timeout well above any BLOCK we issue so that a blocking read is never
    # cut and re-sent by the client.
    kw: dict[str, Any] = {
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": 5,
        "health_check_interval": 30,
    }
    if retries is not None:
        kw["retry"] = async_retry(retries) if asynchronous else sync_retry(retries)
    return kw


def _retries(resilient: bool | int) -> int | None:
    """``resilient``: True for long-lived roles, a number of tries, or False (fail fast)."""
    if resilient is True:
        return RECONNECT_RETRIES
    return None if resilient is False else int(resilient)


def connect(url: str, resilient: bool | int = False) -> Any:
    """A sync client: ``redis.Redis``, or a ``redis.RedisCluster`` for a cluster URL (same
    commands; every Lua script streamrl runs touches keys of one hash slot). ``resilient``
    (True, or a number of tries) retries every command with backoff on connection errors; a
    cluster client that finds no node at all raises ``redis.ConnectionError`` (after the same
    backoff when resilient)."""
    retries = _retries(resilient)
    if not _is_cluster_url(url):
        return redis.Redis.from_url(url, **_client_kwargs(retries, asynchronous=False))
    first, others = cluster_parts(url)
    nodes = [redis.cluster.ClusterNode(h, p) for h, p in others]

    def build() -> PausingCluster:
        kw = _cluster_kwargs()
        try:
            return PausingCluster.from_url(first, startup_nodes=list(nodes), **kw)
        except RedisClusterException as e:  # no node answered: the same error as a plain Redis
            if not cluster_retryable(e):
                raise
            raise redis.ConnectionError(str(e)) from e

    client = build() if retries is None else sync_retry(retries).call_with_retry(build, _noop)
    if retries is not None:
        client.set_retry(sync_retry(retries))
    return client


def connect_async(url: str, resilient: bool | int = False) -> Any:
    retries = _retries(resilient)
    if not _is_cluster_url(url):
        return redis.asyncio.Redis.from_url(url, **_client_kwargs(retries, asynchronous=True))
    first, others = cluster_parts(url)
    nodes = [redis.asyncio.cluster.ClusterNode(h, p) for h, p in others]
    client = PausingAsyncCluster.from_url(first, startup_nodes=nodes, **_cluster_kwargs())
    if retries is not None:
        client.set_retry(async_retry(retries))
    return client


def _noop(_error: Exception) -> None:
    pass


def reach(
    url: str,
    retries: int = RECONNECT_RETRIES,
    on_wait: Callable[[Exception, float], None] | None = None,
) -> Any:
    """A resilient client to ``url`` once it answers PING: a role that starts while Redis
    restarts (or a cluster fails over) waits for it with the reconnect backoff instead of
    exiting. ``on_wait(error, patience_s)`` is called once, at the first failure; after
    ``retries`` tries the last error is raised."""
    told: list[bool] = []

    def first_failure(error: Exception) -> None:
        if not told and on_wait is not None:
            on_wait(error, patience_s(retries))
        told.append(True)

    def probe() -> None:
        client = connect(url)  # fails fast: the backoff is ours
        try:
            client.ping()
        finally:
            client.close()

    retry = Retry(backoff(), retries, supported_errors=(*RETRY_ON, RedisClusterException))
    retry.call_with_retry(probe, first_failure, cluster_retryable)
    return connect(url, resilient=retries)
