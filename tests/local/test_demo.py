"""`streamrl demo`'s machinery end to end, on a step budget (timing lives in the demo itself):
private Redis, producer under admission control, rq rollout workers on the hf backend, the
verifier, the learner process; policy versions flow back to the rollout workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streamrl.local.demo import train_demo
from streamrl.local.procs import descendants, stop_all


# prefork on: the learner and rollout workers forked from one process that imported torch
# (the default); off: each its own `python -m` process
@pytest.mark.parametrize("prefork", ["1", "0"])
def test_demo_trains_and_rollouts_follow_new_policy_versions(tmp_path, monkeypatch, prefork):
    monkeypatch.setenv("STREAMRL_PREFORK", prefork)
    res = train_demo(seconds=180, target=None, live=False, directory=tmp_path, max_steps=12)
    assert res["learner_steps"] >= 12
    assert res["groups_trained"] >= 12 * 8
    assert res["policy_version"] >= 6  # published every 2 steps, v0 at start
    assert res["newest_rollout_version"] >= 1, "rollout workers never loaded a new version"
    assert 0.0 <= res["reward_first"] <= 0.3  # the untrained tiny model is near chance (1/16)
    assert res["samples_scored"] >= 12 * 64
    assert ("prefork" in res["cpu_seconds"]) == (prefork == "1")  # the fork server's own CPU
    log = (tmp_path / "logs" / "learner.log").read_text()
    assert "published" in log and "Traceback" not in log


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def test_sigterm_stops_the_demo_and_everything_it_started(subprocess_env):
    """`kill <demo>` ends it as Ctrl-C does: the learner, the forked workers, the fork server
    and the private Redis all exit, and the summary is still printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "demo", "--json", "--seconds", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**subprocess_env, "COLUMNS": "1000"},  # rich: the header on one line
    )  # fmt: skip
    try:
        header = ""
        while "logs " not in header:
            header = proc.stderr.readline()
            assert header or proc.poll() is None, "the demo exited before starting"
        learner_log = Path(header.rsplit("logs ", 1)[1].strip()) / "learner.log"
        deadline = time.monotonic() + 90
        while '"event": "step"' not in (learner_log.read_text() if learner_log.exists() else ""):
            assert time.monotonic() < deadline, "no learner step within 90 s"
            time.sleep(0.5)
        started = descendants(proc.pid)
        assert len(started) >= 6  # redis, verifier, fork server, learner, 2 rollout workers
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            stop_all([proc])
    assert proc.returncode == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["learner_steps"] >= 1
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in started if _alive(pid)]
    for pid in left:  # orphans of a failed run: ours, by PID
        os.kill(pid, signal.SIGKILL)
    assert not left
