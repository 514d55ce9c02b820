"""Backoff for Redis clients: the ``Retry`` every long-lived role's client carries, and Redis
Cluster clients whose retries pause.

redis-py's cluster clients take only the attempt count of the ``Retry`` they are given and run
their attempts back to back: with streamrl's 150 tries, a command failed 0.4 s into a master
failover that takes seconds (3.6-4.5 s with a 2 s ``cluster-node-timeout``, 16-20 s with the
default 15 s), so the learner and the producer died where a plain Redis client would have
waited. ``PausingCluster`` and ``PausingAsyncCluster`` keep redis-py's quick attempts
(``CLUSTER_QUICK_RETRIES``) and wrap each command, and each pipeline, in the ``Retry`` with its
pauses; between two attempts they read the slot table again and move the default node off a
dead master (redis-py asks that node where a command's keys are, and would not move off it
by itself). Each client logs one warning when its commands start failing and one line when
they work again.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.asyncio.retry
import redis.cluster
import structlog
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import (
    ClusterDownError,
    OutOfMemoryError,
    RedisClusterException,
    SlotNotCoveredError,
)
from redis.retry import Retry

from streamrl.defaults import (
    CLUSTER_QUICK_RETRIES,
    RECONNECT_BASE_S,
    RECONNECT_CAP_S,
    RECONNECT_RETRIES,
)

T = TypeVar("T")
_log = structlog.get_logger("streamrl.connection")


# OOM: a Redis at its maxmemory under noeviction refuses writes that may grow memory; a refused
# command did nothing (a script is refused at its first such write, before any other: Redis
# lets a script that has written go on), so re-sending it once memory frees is safe
RETRY_ON = (redis.ConnectionError, redis.TimeoutError, OutOfMemoryError)
# what a Redis Cluster client raises while a master is down and until its replica has taken
# over: refused connections, CLUSTERDOWN, a slot no live master serves, no startup node that
# answers; every other RedisClusterException (cross-slot keys, bad arguments) is a bug to raise
_CLUSTER_RETRY_ON = (*RETRY_ON, ClusterDownError, RedisClusterException)
_TRANSIENT_CLUSTER = (
    "Redis Cluster cannot be connected",
    "All slots are not covered",
    "startup_nodes could not agree",
)


def cluster_retryable(error: BaseException) -> bool:
    if isinstance(error, (*RETRY_ON, ClusterDownError, SlotNotCoveredError)):
        return True
    return isinstance(error, RedisClusterException) and str(error).startswith(_TRANSIENT_CLUSTER)


def backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=RECONNECT_CAP_S, base=RECONNECT_BASE_S)


def sync_retry(retries: int = RECONNECT_RETRIES) -> Retry:
    return Retry(backoff(), retries, supported_errors=RETRY_ON)


def async_retry(retries: int = RECONNECT_RETRIES) -> redis.asyncio.retry.Retry:
    return redis.asyncio.retry.Retry(backoff(), retries, supported_errors=RETRY_ON)


def patience_s(retries: int = RECONNECT_RETRIES) -> float:
    """How long a client retrying ``retries`` times pauses in all: how long an outage it rides."""
    pauses = backoff()
    return sum(pauses.compute(n) for n in range(1, retries + 1))


# ---------------------------------------------------------------------- Redis Cluster


class _Outage:
    """One warning when a client's commands start failing, one line when they work again:
    the log of a failover says when each role lost the cluster and for how long."""

    def __init__(self, retries: int) -> None:
        self.patience_s = patience_s(retries)
        self.since: float | None = None
        self.failures = 0

    def failed(self, error: BaseException) -> None:
        self.failures += 1
        if self.since is None:
            self.since = time.monotonic()
            _log.warning(
                "Redis Cluster command failed; retrying with backoff (a failover takes about "
                "cluster-node-timeout + a few s)",
                error=" ".join(str(error).split()),
                retrying_for_s=round(self.patience_s),
            )

    def answered(self) -> None:
        if self.since is not None:
            _log.info(
                "Redis Cluster answers again",
                outage_s=round(time.monotonic() - self.since, 2),
                retries=self.failures,
            )
            self.since, self.failures = None, 0


class PausingCluster(redis.RedisCluster):
    _pauses: Retry | None = None  # set by set_retry: resilient clients only
    _outage: _Outage

    def set_retry(self, retry: Retry) -> None:
        self._pauses = Retry(backoff(), retry.get_retries(), _CLUSTER_RETRY_ON)
        self._outage = _Outage(retry.get_retries())
        self.retry = Retry(NoBackoff(), CLUSTER_QUICK_RETRIES, _CLUSTER_RETRY_ON)

    def with_pauses(self, attempt: Callable[[], T]) -> T:
        if self._pauses is None:
            return attempt()
        out = self._pauses.call_with_retry(attempt, self._failed, cluster_retryable)
        self._outage.answered()
        return out

    def _failed(self, error: Exception) -> None:
        """Before the next attempt: read the slot table again and move the default node to a
        master that answers. redis-py asks the default node for the keys of commands whose
        keys it cannot place itself (XREADGROUP, EVALSHA); when that node is the dead
        master, the command fails before it reaches the code that would refresh the table
        or replace the node, so without this every retry fails the same way long after the
        replica has taken over."""
        self._outage.failed(error)
        with contextlib.suppress(Exception):  # nothing answers yet: the next attempt says so
            self.nodes_manager.initialize()
        for node in [self.get_default_node(), *self.get_primaries()]:
            with contextlib.suppress(Exception):
                if node is not None and node.redis_connection is not None:
                    node.redis_connection.ping()
                    self.replace_default_node(node)
                    return

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        run = super().execute_command
        return self.with_pauses(lambda: run(*args, **kwargs))

    def pipeline(self, transaction: Any = None, shard_hint: Any = None) -> Any:
        if self._pauses is None or transaction:
            return super().pipeline(transaction, shard_hint)
        return _RetriedPipeline(self)


class _RetriedPipeline:
    """A cluster pipeline (non-transactional) that a failover cannot cut short: commands are
    queued here and sent in a fresh redis-py pipeline at each attempt, since a pipeline whose
    ``execute`` failed has already emptied itself. What streamrl pipelines is reads and
    idempotent writes, so sending one again is safe."""

    def __init__(self, client: PausingCluster):
        self._client = client
        self._queued: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        if not callable(getattr(redis.cluster.ClusterPipeline, name, None)):
            raise AttributeError(name)

        def queue(*args: Any, **kwargs: Any) -> _RetriedPipeline:
            self._queued.append((name, args, kwargs))
            return self

        return queue

    def __len__(self) -> int:
        return len(self._queued)

    def __enter__(self) -> _RetriedPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.reset()

    def reset(self) -> None:
        self._queued = []

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        queued, self._queued = self._queued, []

        def attempt() -> list[Any]:
            pipe = redis.RedisCluster.pipeline(self._client)
            for name, args, kwargs in queued:
                getattr(pipe, name)(*args, **kwargs)
            replies = pipe.execute(raise_on_error)
            # raise_on_error=False hands errors back as replies (to read a stream that may
            # not exist, say); one that a failover caused is retried, not handed back
            for reply in replies:
                if isinstance(reply, Exception) and cluster_retryable(reply):
                    raise reply
            return replies

        return self._client.with_pauses(attempt)


class PausingAsyncCluster(redis.asyncio.RedisCluster):
    _pauses: redis.asyncio.retry.Retry | None = None
    _outage: _Outage

    def set_retry(self, retry: Any) -> None:
        self._pauses = redis.asyncio.retry.Retry(backoff(), retry.get_retries(), _CLUSTER_RETRY_ON)
        self._outage = _Outage(retry.get_retries())
        self.retry = redis.asyncio.retry.Retry(
            NoBackoff(), CLUSTER_QUICK_RETRIES, _CLUSTER_RETRY_ON
        )

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        run = super().execute_command
        if self._pauses is None:
            return await run(*args, **kwargs)

        async def failed(error: Exception) -> None:
            self._outage.failed(error)
            # read the cluster again before the next attempt, whatever failed: a command
            # whose keys redis-py asks a dead node for fails before redis-py notices
            self._initialize = True

        out = await self._pauses.call_with_retry(
            lambda: run(*args, **kwargs), failed, cluster_retryable
        )
        self._outage.answered()
        return out


def cluster_parts(url: str) -> tuple[str, list[tuple[str, int]]]:
    """``redis+cluster://[auth@]h1:p1,h2:p2[/0][?...]`` -> (a ``redis://`` URL of the first
    node, the other nodes). Several nodes let a client start while one of them is down."""
    scheme, rest = url.split("://", 1)
    auth, at, rest = rest.rpartition("@")
    hosts, tail = re.match(r"([^/?#]*)(.*)", rest).groups()  # type: ignore[union-attr]
    first, *others = hosts.split(",")
    nodes = []
    for node in (n.strip() for n in others):
        m = re.fullmatch(r"\[?([^\[\]/:]+|[0-9a-fA-F:]+)\]?(?::(\d+))?", node)
        if m is None:
            raise ValueError(f"{node!r} in a Redis Cluster URL is not HOST:PORT")
        nodes.append((m.group(1), int(m.group(2) or 6379)))
    plain = f"{scheme.replace('+cluster', '')}://{auth}{at}{first.strip()}{tail}"
    return plain, nodes
