"""What a lease job needs to know about where it runs: its consumer name, its Redis, its run."""

from __future__ import annotations

import os
import socket
from typing import Any

import redis
import redis.asyncio

from streamrl.bus.keys import Keys
from streamrl.config import RUN_CONFIG, RunConfig
from streamrl.connection import async_retry
from streamrl.defaults import RUNS_KEY, SOCKET_TIMEOUT_S

_CONN_FIELDS = ("host", "port", "db", "username", "password", "path", "ssl")


def consumer_name() -> str:
    """The rq worker's name when running as an rq job, so that the next lease on the same
    worker finds (and resumes) what this one left pending; else host-pid."""
    try:
        from rq import get_current_job

        job = get_current_job()
        if job is not None and job.worker_name:
            return job.worker_name
    except Exception:
        pass
    return f"{socket.gethostname()}-{os.getpid()}"


def current_connection() -> redis.Redis:
    from rq import get_current_job

    job = get_current_job()
    if job is None:
        raise RuntimeError("not running inside an rq job")
    return job.connection


def async_twin(conn: redis.Redis) -> redis.asyncio.Redis:
    """An asyncio client to the same server as a sync one (rq hands jobs a sync client),
    reconnecting with backoff like the rq worker's own client."""
    kw: dict[str, Any] = {
        k: v for k, v in conn.connection_pool.connection_kwargs.items() if k in _CONN_FIELDS
    }
    if "path" in kw:
        kw["unix_socket_path"] = kw.pop("path")
    return redis.asyncio.Redis(
        **kw, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5, retry=async_retry()
    )


def url_of(conn: redis.Redis) -> str:
    """A URL for the server behind a client, for components that open their own connection."""
    kw = conn.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    auth = ""
    if kw.get("password"):
        auth = f"{kw.get('username') or ''}:{kw['password']}@"
    scheme = "rediss" if kw.get("ssl") else "redis"
    return (
        f"{scheme}://{auth}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
    )


def read_config(raw: bytes | None) -> RunConfig | None:
    return RUN_CONFIG.decode(raw) if raw else None


def write_config(r: redis.Redis, config: RunConfig) -> None:
    """Store the run's config and list the run, so idle LeaseWorkers keep leases for it."""
    import msgspec

    pipe = r.pipeline(transaction=True)
    pipe.set(Keys(config.run).config, msgspec.msgpack.encode(config))
    pipe.sadd(RUNS_KEY, config.run)
    pipe.execute()
