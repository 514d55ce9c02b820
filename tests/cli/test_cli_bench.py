"""The bench commands as a user runs them: a whole process, JSON on stdout, exit status."""

import json
import subprocess
import sys

import pytest

from streamrl.cli._common import report


def test_bench_pipeline_default_is_single_turn_and_clean(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "streamrl.cli", "bench", "pipeline", "--tasks", "6",
         "--group-size", "2", "--json"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["turns"] == 1 and res["trajectories"] == 12 and res["groups"] == 6
    assert res["lost"] == 0 and res["duplicated"] == 0 and res["dead_letters"] == 0
    # Redis's work by command name: the table adds up to the total, scripts included
    calls = sum(c["calls"] for c in res["commands"].values())
    assert calls == pytest.approx(
        res["redis_commands_per_trajectory"], abs=0.01 * len(res["commands"])
    )
    assert res["commands"]["evalsha"]["calls"] > 0 and res["commands"]["xadd"]["usec"] > 0
    assert 0 < res["redis_usec_per_trajectory"] < sum(c["usec"] for c in res["commands"].values())


def test_report_exits_1_when_the_run_lost_work(capsys):
    report({"lost": 0}, as_json=True)
    assert json.loads(capsys.readouterr().out) == {"lost": 0}
    with pytest.raises(SystemExit) as exc:
        report({"lost": 2}, as_json=False, failed=True)
    assert exc.value.code == 1
    assert json.loads(capsys.readouterr().out) == {"lost": 2}
