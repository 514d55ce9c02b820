"""``bench/demo_phases.py``'s bins, from a demo result's timeline and CPU readings."""

from __future__ import annotations

import pytest

from tests.support.bench_scripts import load_bench


def _module():
    return load_bench("demo_phases")


def test_phases_bins_the_timeline_and_reads_the_cpu_between_its_ends():
    mod = _module()
    start = 1000.0
    # a row a second: 30 steps/s and 64 samples a step for 4 s, then 10 steps/s and 200
    timeline = [[float(t), 30 * t, 64 * 30 * t, 0.1, 3.0, 0.0] for t in range(5)]
    timeline += [[float(t), 120 + 10 * (t - 4), 7680 + 2000 * (t - 4), 0.85, 0.4, 0.3]
                 for t in range(5, 9)]  # fmt: skip
    # CPU readings every half second: busy half the time until 4 s, then all of it
    cpu, busy, total = [], 0, 0
    for i in range(20):
        t = start + i / 2
        cpu.append((t, busy, total))
        busy, total = busy + (50 if t < start + 4 else 100), total + 100
    rows = mod.phases({"timeline": timeline, "started_at": start}, cpu, width=2.0)
    assert [r["seconds"] for r in rows] == [2.0, 4.0, 6.0, 8.0]
    assert [r["steps_per_s"] for r in rows[:2]] == [30.0, 30.0]
    assert [r["samples_per_step"] for r in rows[:2]] == [64.0, 64.0]
    assert rows[-1]["steps_per_s"] == 10.0 and rows[-1]["samples_per_step"] == 200.0
    assert rows[0]["cpu_busy"] == pytest.approx(0.5) and rows[-1]["cpu_busy"] == 1.0
    assert rows[-1]["entropy_coef"] == 0.3 and rows[-1]["reward"] == 0.85
