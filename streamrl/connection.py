"""Where the Redis URL comes from, and clients configured for long blocking stream reads."""

from __future__ import annotations

import os
from pathlib import Path

import redis
import redis.asyncio

from streamrl.defaults import RUN_DIR, SOCKET_TIMEOUT_S

ENV_URL = "STREAMRL_REDIS_URL"


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


def connect(url: str) -> redis.Redis:
    # redis-py 8 retries on timeouts by default; keep the socket timeout well above any BLOCK
    # we issue so that a blocking read is never cut and re-sent by the client.
    return redis.Redis.from_url(
        url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5, health_check_interval=30
    )


def connect_async(url: str) -> redis.asyncio.Redis:
    return redis.asyncio.Redis.from_url(
        url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5, health_check_interval=30
    )
