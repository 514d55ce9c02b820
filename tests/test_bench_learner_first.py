"""``bench/learner_first.py``'s readings: the time to a step from the demo's timeline, and the
shares of thread samples in which the learner was runnable or alone."""

from __future__ import annotations

from tests.support.bench_scripts import load_bench


def _module():
    return load_bench("learner_first")


def test_seconds_at_step_is_the_first_row_that_reached_it():
    mod = _module()
    timeline = [[1.0, 0, 0, 0.0, 3.0, 0.0], [2.0, 40, 2560, 0.1, 3.0, 0.0],
                [3.0, 70, 4480, 0.1, 3.0, 0.0], [4.0, 200, 9000, 0.3, 2.5, 0.0]]  # fmt: skip
    assert mod.seconds_at(timeline, (50, 70, 200, 500)) == {50: 3.0, 70: 3.0, 200: 4.0, 500: None}


def test_thread_shares_counts_only_the_window_and_tells_the_learner_alone():
    mod = _module()
    samples = [
        (0.5, ["worker", "worker", "learner"]),  # before the window
        (1.0, ["learner"]),
        (2.0, ["learner", "worker"]),
        (3.0, ["worker"]),
        (4.0, []),
        (5.0, ["learner"]),
        (9.0, []),  # after it
    ]
    shares = mod.thread_shares(samples, 1.0, 5.0)
    assert shares == {
        "samples": 5,
        "learner_runnable": 0.6,
        "at_most_one_runnable": 0.8,
        "learner_alone": 0.4,
    }
    assert mod.thread_shares(samples, 20.0, 30.0) == {}
