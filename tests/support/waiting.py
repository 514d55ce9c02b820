"""Bounded waits for a condition in tests: a deadline, not a timing assertion."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(
    cond: Callable[[], T],
    what: str,
    timeout: float = 120.0,
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``cond`` until it returns something truthy and return that; fail naming ``what``
    after ``timeout`` seconds. Exceptions in ``ignore`` (a Redis that is restarting) count as
    not yet."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(*ignore):
            value = cond()
            if value:
                return value
        assert time.monotonic() < deadline, f"gave up after {timeout} s waiting for {what}"
        time.sleep(0.05)
