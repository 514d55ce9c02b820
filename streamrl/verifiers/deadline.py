"""A wall-clock deadline around each verifier call.

Verifiers run in the main thread of an rq work horse, where rq's own job timeout also uses
SIGALRM. ``Deadlines`` takes the signal for a whole batch of calls: it installs its handler
once, arms the timer for each call and, between calls, re-arms rq's timer with what is left
of it; an alarm that is not a call's goes to rq's handler. Installing a handler costs far
more than arming a timer (``signal.signal`` maps the old handler through an enum, which
raises and catches for a function): once per call it was a fifth of a verifier worker's CPU
on a cheap verifier. A verifier stuck in C code that ignores signals is caught one level up:
the lease job times out, the entry is redelivered, and after ``max_deliveries`` it is
dead-lettered.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any


class VerifierTimeout(Exception):
    pass


class Deadlines:
    """``with Deadlines() as d:`` then ``with d.call(seconds):`` around each verifier call.
    Outside the main thread (where no signal can be delivered) it does nothing."""

    def __init__(self) -> None:
        self._active = threading.current_thread() is threading.main_thread()
        self._previous: Any = None
        self._outer_due: float | None = None  # when the timer found armed (rq's) fires
        self._outer_interval = 0.0
        self._seconds: float | None = None  # the call in progress, if any

    def __enter__(self) -> Deadlines:
        if self._active:
            self._previous = signal.signal(signal.SIGALRM, self._alarm)
            delay, self._outer_interval = signal.setitimer(signal.ITIMER_REAL, 0)
            self._outer_due = time.monotonic() + delay if delay > 0 else None
            self._rearm_outer()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            previous = signal.SIG_DFL if self._previous is None else self._previous
            signal.signal(signal.SIGALRM, previous)
            self._rearm_outer()

    def call(self, seconds: float) -> _Call:
        return _Call(self, seconds)

    def _rearm_outer(self) -> None:
        """Give the outer timer what is left of it (at least 1 ms: one that came due during a
        call fires now, as it would have then)."""
        if self._outer_due is not None:
            left = max(self._outer_due - time.monotonic(), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, self._outer_interval)

    def _alarm(self, signum: int, frame: FrameType | None) -> None:
        if self._seconds is not None:
            seconds, self._seconds = self._seconds, None
            raise VerifierTimeout(f"verifier did not finish within {seconds:g} s")
        interval = self._outer_interval
        self._outer_due = time.monotonic() + interval if interval > 0 else None
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:  # the default action: end the process, as it would
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGALRM)


class _Call:
    """One call's timer: a plain context manager (a generator-based one costs more than the
    timer itself)."""

    __slots__ = ("_d", "_seconds")

    def __init__(self, d: Deadlines, seconds: float) -> None:
        self._d, self._seconds = d, seconds

    def __enter__(self) -> None:
        d = self._d
        if self._seconds > 0 and d._active:
            d._seconds = self._seconds
            signal.setitimer(signal.ITIMER_REAL, self._seconds)

    def __exit__(self, *exc: object) -> None:
        d = self._d
        if self._seconds > 0 and d._active:
            signal.setitimer(signal.ITIMER_REAL, 0)
            d._seconds = None
            d._rearm_outer()


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """One call's deadline (``Deadlines`` for one call)."""
    with Deadlines() as d, d.call(seconds):
        yield
