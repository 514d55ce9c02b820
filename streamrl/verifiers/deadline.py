"""A wall-clock deadline around a verifier call.

Verifiers run in the main thread of an rq work horse, where rq's own job timeout also uses
SIGALRM; this saves rq's timer and handler and puts them back afterwards, so both work.
A verifier stuck in C code that ignores signals is caught one level up: the lease job times
out, the entry is redelivered, and after ``max_deliveries`` it is dead-lettered.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class VerifierTimeout(Exception):
    pass


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def _expired(signum, frame):
        raise VerifierTimeout(f"verifier did not finish within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, _expired)
    prev_delay, prev_interval = signal.setitimer(signal.ITIMER_REAL, seconds)
    start = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if prev_delay > 0:
            left = max(prev_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, left, prev_interval)
