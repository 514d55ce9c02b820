"""`streamrl demo`'s machinery end to end, on a step budget (timing lives in the demo itself):
private Redis, producer under admission control, rq rollout workers on the hf backend, the
verifier, the learner process; policy versions flow back to the rollout workers."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import psutil
import pytest

from streamrl.config import load_toml
from streamrl.defaults import DEMO_WORKER_NICE
from streamrl.learner.config import load_learner_config
from streamrl.local.demo import DEMO_CONFIG, DemoOptions, learner_toml, train_demo
from streamrl.local.procs import descendants, role_of, stop_all
from tests.support.waiting import wait_for


# prefork on: the learner and rollout workers forked from one process that imported torch
# (the default); off: each its own `python -m` process
@pytest.mark.parametrize("prefork", ["1", "0"])
def test_demo_trains_and_rollouts_follow_new_policy_versions(tmp_path, monkeypatch, prefork):
    monkeypatch.setenv("STREAMRL_PREFORK", prefork)
    opts = DemoOptions(seconds=300, target=None, live=False, directory=tmp_path, max_steps=250)
    res = train_demo(opts)
    assert res["learner_steps"] >= 250, res
    assert res["groups_trained"] >= 250 * 8
    assert res["policy_version"] >= 125  # published every 2 steps, v0 at start
    assert res["newest_rollout_version"] >= 1, "rollout workers never loaded a new version"
    assert 0.0 <= res["reward_first"] <= 0.3  # the untrained tiny model is near chance (1/16)
    # it learned: the mean of the last 512 rewards is well above that of the first 512 (the
    # copy reward of the untrained model is about 0.04, after 250 steps about 0.15; one
    # window's mean varies by about 0.01)
    assert res["reward_last"] >= res["reward_first"] + 0.05, res
    assert res["samples_scored"] >= 250 * 64
    assert ("prefork" in res["cpu_seconds"]) == (prefork == "1")  # the fork server's own CPU
    # the once-a-second timeline (bench/demo_phases.py), from when the demo starts watching:
    # time, steps and samples only grow, the last row is close to the result's own counts,
    # the entropy is the learner's
    rows = res["timeline"]
    assert len(rows[0]) == len(res["timeline_columns"]) == 6
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(rows)]
    assert len(rows) >= 5 and min(gaps) >= 1.0 and sorted(gaps)[len(gaps) // 2] < 1.5, gaps
    for col in range(3):
        assert all(a[col] <= b[col] for a, b in itertools.pairwise(rows)), col
    assert rows[-1][1] >= res["learner_steps"] - 60 and rows[-1][2] <= res["samples_scored"]
    assert 0 < rows[-1][4] < 3.3  # nats: below log(24), the tiny vocabulary's maximum
    log = (tmp_path / "logs" / "learner.log").read_text()
    assert "published" in log and "Traceback" not in log


def test_the_learner_config_file_keeps_quotes_and_backslashes(tmp_path):
    """The file the demo hands `streamrl learn` is real TOML: a run name or a path with a quote
    or a backslash (a Windows path, a directory named by a user) reads back as written."""
    cfg = load_toml(DEMO_CONFIG)
    cfg.run = 'say "hi"'
    cfg.policy.model = r'C:\models\"tiny" model'
    cfg.learner = {**cfg.learner, "model": cfg.policy.model, "output_dir": r"out\"x"}
    path = tmp_path / "demo.toml"
    path.write_text(learner_toml(cfg))
    back = tomllib.loads(path.read_text())
    assert back["run"] == 'say "hi"'
    assert back["policy"]["model"] == r'C:\models\"tiny" model'
    assert back["learner"] == cfg.learner
    learner = load_learner_config(path)  # what `streamrl learn --config` reads
    assert (learner.model, learner.output_dir) == (cfg.policy.model, r"out\"x")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _assert_none_left(started: list[int]) -> None:
    """Every process the demo had started is gone within 10 s of its exit."""
    with contextlib.suppress(AssertionError):  # `assert not left` below says who stayed
        wait_for(lambda: not any(_alive(p) for p in started), "its processes", 10, every=0.2)
    left = [pid for pid in started if _alive(pid)]
    assert not left, f"still running after the demo: {left}"


def _end(proc: subprocess.Popen, started: list[int]) -> None:
    """The demo and the orphans of a failed run (ours, by PID)."""
    if proc.poll() is None:
        stop_all([proc])
    for pid in started:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("to_group", [False, True], ids=["demo", "process-group"])
def test_sigterm_stops_the_demo_and_everything_it_started(subprocess_env, to_group):
    """`kill <demo>` ends it as Ctrl-C does: the learner, the forked workers, the fork server
    and the private Redis all exit, and the summary is still printed. Also when the signal
    goes to the demo's whole process group (`kill -TERM -- -PGID`, a terminal's or a job
    runner's way): it kills the fork server too, and its forked workers, in sessions of their
    own, used to read as exited to the demo and ran on."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "demo", "--json", "--seconds", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**subprocess_env, "COLUMNS": "1000"},  # rich: the header on one line
        start_new_session=to_group,  # a group of its own to signal, not pytest's
    )  # fmt: skip
    started: list[int] = []
    try:
        header = ""
        while "logs " not in header:
            header = proc.stderr.readline()
            assert header or proc.poll() is None, "the demo exited before starting"
        learner_log = Path(header.rsplit("logs ", 1)[1].strip()) / "learner.log"
        wait_for(
            lambda: learner_log.exists() and '"event": "step"' in learner_log.read_text(),
            "a learner step",
            timeout=90,
            every=0.5,
        )
        started = descendants(proc.pid)
        assert len(started) >= 6  # redis, verifier, fork server, learner, 2 rollout workers
        # the learner first (DemoOptions.worker_nice): every worker thread, work horses included, at
        # the lowest priority; the learner, Redis and the fork server as they were
        nice = _nice_by_role(started)
        assert nice["worker"] == {DEMO_WORKER_NICE} and nice["learner"] == {0}, nice
        assert nice["redis"] == {0} and nice["prefork"] == {0}, nice
        if to_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0
        summary = json.loads(out.strip().splitlines()[-1])
        assert summary["learner_steps"] >= 1
        _assert_none_left(started)
    finally:
        _end(proc, started)


def test_sigterm_during_start_up_says_so_and_leaves_nothing_running(subprocess_env):
    """A demo stopped while the fork server still imports torch (before the header, before
    any training) says it was interrupted during start-up in one line and exits 130, not
    click's bare `Aborted!` with 1; the private Redis and the fork server go with it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "demo", "--json", "--seconds", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env,
    )  # fmt: skip
    started: list[int] = []
    try:
        # the private Redis is up (~0.3 s in) long before the fork server's imports end (~3 s)
        wait_for(
            lambda: any(_role(pid) == "redis" for pid in descendants(proc.pid)),
            "the demo's private Redis",
            timeout=30,
            every=0.05,
        )
        started = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert "logs " not in err, "the signal came after start-up: the test did not test it"
        assert proc.returncode == 130, err
        assert err.strip().splitlines()[-1].startswith("streamrl demo: interrupted during start-up")
        assert "Aborted" not in err and "Traceback" not in err and out == "", err
        _assert_none_left(started)
    finally:
        _end(proc, started)


def _role(pid: int) -> str:
    """What process ``pid`` is (``procs.role_of``), or "gone"."""
    try:
        return role_of(" ".join(psutil.Process(pid).cmdline()))
    except psutil.Error:
        return "gone"


def _nice_by_role(pids: list[int]) -> dict[str, set[int]]:
    """The nice values of every thread of ``pids``, by what each process is."""
    out: dict[str, set[int]] = {}
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            role = _role(pid)
            for t in psutil.Process(pid).threads():
                out.setdefault(role, set()).add(os.getpriority(os.PRIO_PROCESS, t.id))
    return out


@pytest.mark.parametrize("as_json", [True, False])
def test_the_people_summary_leaves_the_timeline_to_json(monkeypatch, as_json):
    """`streamrl demo` prints its summary indented for a person: there the once-a-second
    timeline (hundreds of lines at one number a line) is replaced by its row count; `--json`
    keeps it whole. (The training run itself is the test above; here only what is printed.)"""
    from click.testing import CliRunner

    import streamrl.local.demo as local_demo
    from streamrl.cli import main

    rows = [[float(t), t, 64 * t, 0.5, 1.0, 0.0] for t in range(90)]
    summary = {"reward_last": 0.9, "timeline_columns": ["seconds"], "timeline": rows}
    monkeypatch.setattr(local_demo, "train_demo", lambda opts: dict(summary))
    res = CliRunner().invoke(main, ["demo", *(["--json"] if as_json else [])])
    assert res.exit_code == 0, res.output
    printed = json.loads(res.output)
    if as_json:
        assert printed["timeline"] == rows and printed["timeline_columns"] == ["seconds"]
    else:
        assert printed == {"reward_last": 0.9, "timeline": "90 rows, in --json"}
        assert len(res.output.splitlines()) < 10
