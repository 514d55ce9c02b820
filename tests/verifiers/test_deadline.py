"""The verifier's per-call deadline shares SIGALRM with rq's job timeout: each call is cut at
its own time, and the outer timer (rq's) still fires on time, between calls and after."""

from __future__ import annotations

import signal
import time

import pytest

from streamrl.verifiers.deadline import Deadlines, VerifierTimeout, deadline


class OuterTimeout(Exception):
    pass


@pytest.fixture
def outer_timer():
    """An rq-like job timeout: its own SIGALRM handler, armed with ``signal.setitimer``. The
    test's own timer (pytest-timeout's, if it uses the signal) is put back afterwards."""

    def fire(signum, frame):
        raise OuterTimeout

    previous = signal.signal(signal.SIGALRM, fire)
    timer = signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        yield fire
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if timer[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *timer)


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_each_call_gets_its_own_deadline_and_the_outer_timer_is_kept(outer_timer):
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    with Deadlines() as d:
        for _ in range(3):
            with pytest.raises(VerifierTimeout, match=r"0\.05 s"), d.call(0.05):
                spin(2.0)
            with d.call(0.5):
                spin(0.01)  # done in time: nothing raised
    assert signal.getsignal(signal.SIGALRM) is outer_timer
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    assert 3.5 < left < 5.0, left  # what was left of the outer timer, re-armed


def test_the_outer_timer_fires_between_calls_and_after_a_call_it_came_due_in(outer_timer):
    signal.setitimer(signal.ITIMER_REAL, 0.1)
    with pytest.raises(OuterTimeout), Deadlines() as d:
        with d.call(5.0):
            spin(0.3)  # the outer timer comes due here: the call is not cut for it
        spin(2.0)  # ... and it fires as soon as the call ends
    assert signal.getsignal(signal.SIGALRM) is outer_timer

    signal.setitimer(signal.ITIMER_REAL, 0.1)
    with pytest.raises(OuterTimeout), Deadlines():
        spin(2.0)  # between calls, the outer handler is the one that runs


def test_a_call_without_an_outer_timer_leaves_the_timer_off(outer_timer):
    with pytest.raises(VerifierTimeout), deadline(0.05):
        spin(2.0)
    with deadline(0.5):
        pass
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is outer_timer
