"""Policy health: which policy version each rollout worker serves, and the run's fault.

Every rollout lease writes a ``WorkerPolicy`` record into the run's ``policy_health`` hash on
each heartbeat: the version its backend serves, the newest version announced on the
``policy`` stream, and the backend's last reload error. The staleness guard: a worker that
stays more than ``max_staleness`` versions (the run config's ``[learner]`` value) behind the
newest one for longer than ``rollout.max_policy_lag_s`` stops taking tasks, leaves what it
holds pending for other workers, sets the run's ``fault`` key and fails its lease with
``PolicyStale`` (so the rq job lands in the failed registry with the reason as its last
line). The learner and ``streamrl demo`` stop with the fault as one line (``RunFaulted``);
``streamrl status`` shows it. The worker that raised a fault clears it once it serves a
recent enough version again (a later lease of the same rq worker retries the load).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import redis

from streamrl import defaults as d
from streamrl.bus.keys import Keys
from streamrl.config import RunConfig
from streamrl.schema import WORKER_POLICY, WorkerPolicy

_MAX_REASON_CHARS = 400


class PolicyStale(RuntimeError):
    """A rollout worker has served a too old policy for too long (raised by its lease)."""


class RunFaulted(RuntimeError):
    """The run is faulted: the command line stops with its one-line reason (``Error: ...``, exit
    status 1)."""


def one_line(text: str, limit: int = _MAX_REASON_CHARS) -> str:
    """Whitespace (newlines included) collapsed, cut to ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def max_staleness(config: RunConfig) -> int:
    return int(config.learner.get("max_staleness", d.MAX_STALENESS))


def _stale_after(heartbeat_s: float) -> float:
    """Seconds after which a health record belongs to no live lease."""
    return d.POLICY_HEALTH_STALE_HEARTBEATS * heartbeat_s + d.POLICY_HEALTH_STALE_S


def is_fresh(record: WorkerPolicy, now: float) -> bool:
    return now - record.updated_at <= _stale_after(record.heartbeat_s)


def decode(raw: bytes) -> WorkerPolicy | None:
    try:
        return WORKER_POLICY.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def lag(record: WorkerPolicy) -> int:
    return 0 if record.newest is None else max(0, record.newest - record.version)


def observe(
    previous: WorkerPolicy | None,
    *,
    worker: str,
    backend: str,
    version: int,
    newest: int | None,
    error: str | None,
    max_staleness: int,
    heartbeat_s: float,
    now: float,
    server: str = "",
    requests: tuple[int, int] = (0, 0),
) -> WorkerPolicy:
    """The worker's new record. ``behind_since`` carries over from ``previous`` while the
    worker stays too far behind, so a worker is timed across its leases."""
    record = WorkerPolicy(
        worker=worker,
        backend=backend,
        version=version,
        newest=newest,
        error=one_line(error) if error else None,
        max_staleness=max_staleness,
        heartbeat_s=heartbeat_s,
        fault=previous.fault if previous else None,
        updated_at=now,
        server=server,
        in_flight=requests[0],
        waiting=requests[1],
    )
    if lag(record) > max_staleness:
        since = previous.behind_since if previous else None
        record.behind_since = since if since is not None else now
    return record


def stale_reason(record: WorkerPolicy, max_lag_s: float, now: float) -> str | None:
    """Why the guard trips for this record, or None (``max_lag_s <= 0`` turns it off)."""
    if record.behind_since is None or max_lag_s <= 0 or now - record.behind_since <= max_lag_s:
        return None
    return one_line(
        f"worker {record.worker} serves policy version {record.version}, {lag(record)} behind "
        f"newest {record.newest} (max_staleness {record.max_staleness}) for "
        f"{now - record.behind_since:.0f} s; last reload error: {record.error or 'none'}"
    )


# ---------------------------------------------------------------------- readers (sync)


def fault(r: redis.Redis, keys: Keys) -> str | None:
    raw = r.get(keys.fault)
    return raw.decode(errors="replace") if raw else None


def check_fault(r: redis.Redis, keys: Keys) -> None:
    """Raise ``RunFaulted`` when the run's fault key is set."""
    reason = fault(r, keys)
    if reason is not None:
        raise RunFaulted(one_line(reason))


def policy_health(r: redis.Redis, keys: Keys, now: float | None = None) -> dict[str, Any]:
    """For ``streamrl status``: the run's fault, and per rollout worker with a live lease the
    version it serves, how far behind the newest it is, for how long, and its last reload
    error. Records not updated for ``3 * heartbeat_s + 10`` seconds are counted, not shown."""
    now = time.time() if now is None else now
    workers: dict[str, dict[str, Any]] = {}
    ignored = 0
    for raw in r.hvals(keys.policy_health):
        record = decode(raw)
        if record is None or not is_fresh(record, now):
            ignored += 1
            continue
        workers[record.worker] = {
            "backend": record.backend,
            "version": record.version,
            "newest": record.newest,
            "lag": lag(record),
            "behind_s": (
                round(now - record.behind_since, 1) if record.behind_since is not None else None
            ),
            "error": record.error,
            "server": record.server,
            "in_flight": record.in_flight,
            "waiting": record.waiting,
            "updated_s_ago": round(now - record.updated_at, 1),
        }
    return {"fault": fault(r, keys), "workers": dict(sorted(workers.items())), "ignored": ignored}
