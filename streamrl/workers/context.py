"""What a lease job needs to know about where it runs: its consumer name, its Redis, its run."""

from __future__ import annotations

import inspect
import os
import socket
from typing import Any
from urllib.parse import urlencode

import redis
import redis.asyncio
from redis.connection import SSLConnection

from streamrl.bus.keys import Keys
from streamrl.config import RUN_CONFIG, RunConfig
from streamrl.connection import ENV_DATA_URL, async_retry, connect, connect_async, is_cluster
from streamrl.defaults import RUNS_KEY, SOCKET_TIMEOUT_S

_CONN_FIELDS = ("host", "port", "db", "username", "password", "path", "ssl")
_ASYNC_TLS_OPTIONS = frozenset(
    name
    for name in inspect.signature(redis.asyncio.Redis.__init__).parameters
    if name.startswith("ssl_")
)


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


def control_connection() -> redis.Redis:
    """rq's own client (the control Redis) of the job running now."""
    from rq import get_current_job

    job = get_current_job()
    if job is None:
        raise RuntimeError("not running inside an rq job")
    return job.connection


_data: dict[str, Any] = {}


def data_url(control: redis.Redis) -> str:
    """The run's data Redis: ``STREAMRL_DATA_URL`` when the worker was given one (a Redis
    Cluster, or any Redis other than rq's), else rq's own server."""
    return os.environ.get(ENV_DATA_URL) or _url_of(control)


def data_connection(control: redis.Redis) -> Any:
    """A sync client for the run's data: rq's own client unless ``STREAMRL_DATA_URL`` names
    another Redis (one client per process, reconnecting with backoff)."""
    url = os.environ.get(ENV_DATA_URL)
    if not url:
        return control
    client = _data.get(url)
    if client is None:
        client = _data[url] = connect(url, resilient=True)
    return client


def async_twin(conn: Any) -> Any:
    """An asyncio client to the same server as a sync one (rq hands jobs a sync client),
    reconnecting with backoff like the rq worker's own client."""
    url = os.environ.get(ENV_DATA_URL)
    if url and conn is _data.get(url):
        return connect_async(url, resilient=True)
    kw: dict[str, Any] = {
        k: v for k, v in conn.connection_pool.connection_kwargs.items() if k in _CONN_FIELDS
    }
    if "path" in kw:
        kw["unix_socket_path"] = kw.pop("path")
    tls = _tls_options(conn)
    if tls is not None:
        kw.update(ssl=True, **tls)
    return redis.asyncio.Redis(
        **kw, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=5, retry=async_retry()
    )


def _url_of(conn: redis.Redis) -> str:
    """A URL for the server behind a client, for components that open their own connection."""
    kw = conn.connection_pool.connection_kwargs
    if kw.get("path"):
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    auth = ""
    if kw.get("password"):
        auth = f"{kw.get('username') or ''}:{kw['password']}@"
    tls = _tls_options(conn)
    scheme = "rediss" if tls is not None else "redis"
    query = urlencode({k: v for k, v in (tls or {}).items() if isinstance(v, (str, bool, int))})
    return (
        f"{scheme}://{auth}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
        + (f"?{query}" if query else "")
    )


def _tls_options(conn: redis.Redis) -> dict[str, Any] | None:
    """The TLS settings of a client (CA file, client certificate, checks), None without TLS.
    ``rediss://`` makes redis-py use ``SSLConnection`` with ``ssl_*`` options: a twin or a URL
    built without them would talk plain TCP, or trust other certificates."""
    pool = conn.connection_pool
    if not (pool.connection_kwargs.get("ssl") or issubclass(pool.connection_class, SSLConnection)):
        return None
    kw = pool.connection_kwargs
    return {k: v for k, v in kw.items() if k in _ASYNC_TLS_OPTIONS and v is not None}


def read_config(raw: bytes | None) -> RunConfig | None:
    return RUN_CONFIG.decode(raw) if raw else None


def write_config(r: redis.Redis, config: RunConfig) -> None:
    """Store the run's config and list the run, so idle LeaseWorkers keep leases for it."""
    import msgspec

    # one transaction on a plain Redis; a cluster cannot span the two slots, and a run whose
    # config is written but not yet listed is only picked up by the next write
    pipe = r.pipeline(transaction=not is_cluster(r))
    pipe.set(Keys(config.run).config, msgspec.msgpack.encode(config))
    pipe.sadd(RUNS_KEY, config.run)
    pipe.execute()
