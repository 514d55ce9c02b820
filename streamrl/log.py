"""structlog setup shared by every role, and a limiter for errors that repeat.

Format: ``STREAMRL_LOG_FORMAT`` (or ``streamrl --log-format``) is ``json`` (one JSON object a
line, for log shippers), ``console`` (key=value lines for a person) or ``auto`` (the default:
console on a terminal, JSON otherwise). ``STREAMRL_LOG_LEVEL`` sets the level (``info``).

Keys. Every line carries ``run``, ``role`` and ``worker`` (``null`` where a process has not
bound them yet), and a line about one episode or one policy also ``task_id`` and
``policy_version``: the same names in the producer, the rollout and verifier workers, the
learner and the exporter, so one query follows a task or a version across roles.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import MutableMapping
from typing import Any

import structlog

_ENV_FORMAT = "STREAMRL_LOG_FORMAT"
_ENV_LEVEL = "STREAMRL_LOG_LEVEL"
FORMATS = ("auto", "json", "console")
_ALWAYS = ("run", "role", "worker")  # present on every line


def _standard_keys(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
    for key in _ALWAYS:
        event.setdefault(key, None)
    return event


def log_format(fmt: str | None = None) -> str:
    """``json`` or ``console``: ``fmt``, else ``STREAMRL_LOG_FORMAT``, else by terminal."""
    fmt = (fmt or os.environ.get(_ENV_FORMAT) or "auto").strip().lower()
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    if fmt == "auto":
        return "console" if sys.stderr.isatty() else "json"
    return fmt


def log_level(level: int | str | None = None) -> int:
    value = level if level is not None else os.environ.get(_ENV_LEVEL, "info")
    if isinstance(value, int):
        return value
    named = logging.getLevelNamesMapping().get(value.strip().upper())
    if named is None:
        raise ValueError(f"log level {value!r}: expected debug, info, warning or error")
    return named


def configure(level: int | str | None = None, fmt: str | None = None) -> None:
    """Set structlog up for this process (idempotent; a later call with a format wins)."""
    chosen = log_format(fmt)
    if fmt and fmt != "auto":
        os.environ[_ENV_FORMAT] = chosen  # child processes (rq work horses) log the same way
    renderer = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())  # no escapes in a file
        if chosen == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _standard_keys,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(log_level(level)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def bind(**keys: Any) -> None:
    """Bind the standard keys (``run``, ``role``, ``worker``, ...) for this context."""
    structlog.contextvars.bind_contextvars(**{k: v for k, v in keys.items() if v is not None})


class Repeats:
    """Says whether to write a line that may repeat on every batch: the first time an error
    is seen, when it changes, and then at most every ``every_s`` seconds with the number of
    repeats in between. A failing policy reload is retried every second or every batch;
    its log must not grow with it."""

    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s
        self._last: dict[str, tuple[str, float, int]] = {}  # key -> (message, when, skipped)

    def check(self, key: str, message: str, now: float | None = None) -> int | None:
        """``None``: stay quiet. Otherwise write the line, with the returned count of
        identical lines left out since the last one written."""
        now = time.monotonic() if now is None else now
        prev = self._last.get(key)
        if prev is None or prev[0] != message or now - prev[1] >= self.every_s:
            self._last[key] = (message, now, 0)
            return prev[2] if prev is not None and prev[0] == message else 0
        self._last[key] = (prev[0], prev[1], prev[2] + 1)
        return None

    def clear(self, key: str) -> None:
        """The condition is over (a reload worked): the next failure is news again."""
        self._last.pop(key, None)
