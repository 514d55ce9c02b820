"""``streamrl bench soak``'s verdict, on made-up series: growth that levels off passes, growth
that goes on fails, and noise around a flat line passes. (The soak itself runs for minutes: it
is a benchmark, not a test.)"""

from __future__ import annotations

import math

import pytest

from streamrl.benchmarks.soak import FLOORS, judge, slope_per_hour


def _samples(shape) -> list[dict]:
    out = []
    for i in range(360):  # an hour, every 10 s
        t = 10.0 * i
        row = {name: shape(t) for name in FLOORS}
        row.update(t_s=t, groups_per_s=7.0, redis_keys=shape(t))
        out.append(row)
    return out


def test_slope_per_hour_is_least_squares():
    assert slope_per_hour([0, 3600, 7200], [1, 2, 3]) == pytest.approx(1.0)
    assert slope_per_hour([0, 10], [5, 5]) == 0.0


def test_levelling_off_passes_and_steady_growth_fails():
    levels = judge(_samples(lambda t: 300 * (1 - math.exp(-t / 300))))  # flat after ~20 min
    grows = judge(_samples(lambda t: 100 + t / 60))  # +60 per hour, for ever
    noisy = judge(_samples(lambda t: 300 + (25 if int(t / 10) % 2 else -25)))
    assert all(v["flat"] for v in levels.values())
    assert not any(grows[name]["flat"] for name in FLOORS if FLOORS[name] < 60 * 0.9)
    assert grows["redis_keys_no_ttl"]["flat"]  # +60/h is under the keys' floor of 100/h
    assert all(v["flat"] for v in noisy.values())


def test_throughput_that_stops_fails():
    samples = _samples(lambda t: 10.0)
    samples[-1]["groups_per_s"] = 0.0
    assert not judge(samples)["groups_per_s"]["flat"]
