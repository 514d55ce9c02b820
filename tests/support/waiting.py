"""Bounded waits for a condition in tests: a deadline, not a timing assertion."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    cond: Callable[[], T],
    what: str | Callable[[], str],
    timeout: float = 120.0,
    ignore: tuple[type[BaseException], ...] = (),
    every: float = 0.05,
) -> T:
    """Poll ``cond`` every ``every`` seconds until it returns something truthy and return that;
    fail naming ``what`` after ``timeout`` seconds. ``what`` may be a function, called only then,
    to say what the run looked like at the end (a log tail). Exceptions in ``ignore`` (a Redis
    that is restarting) count as not yet; any other exception, an assertion inside ``cond``
    included, fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(*ignore):
            value = cond()
            if value:
                return value
        if time.monotonic() >= deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"gave up after {timeout} s waiting for {said}")
        time.sleep(every)
