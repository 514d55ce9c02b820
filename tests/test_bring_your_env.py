"""The README's "Bring your environment" examples, executed as written: each one's Python block
and shell commands run in a fresh directory (with the repository's `examples/` beside them),
against a private Redis, with real worker processes, and the scores they produce are checked."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.local.pipeline import xrange_all
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
SECTION = (ROOT / "README.md").read_text().split("## Bring your environment", 1)[1]
SECTION = SECTION.split("\n## ", 1)[0]


def _blocks(title: str, lang: str) -> list[str]:
    """The ``lang`` code blocks of the example that starts at ``title``."""
    part = SECTION.split(f"**{title}", 1)[1].split("\n**", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", part, re.S)


def _example(title: str) -> tuple[str, list[str]]:
    """The Python block and the command lines of the example's last shell block."""
    py, sh = _blocks(title, "python"), _blocks(title, "bash")
    assert sh, f"the {title} example has no commands"
    lines = [x for x in sh[-1].replace("\\\n", " ").splitlines() if x.strip()]
    return (py[0] if py else ""), lines


def _argv(command: str) -> list[str]:
    words = shlex.split(command)
    assert words[0] == "streamrl", command
    return [sys.executable, "-m", "streamrl.cli", *words[1:]]


def _run_example(
    title: str, run: str, redis_url: str, env: dict, cwd: Path, edit=lambda line: line
) -> list:
    """Run the example (each command line through ``edit``); returns the worker processes
    its `&` lines started."""
    env = {**env, "STREAMRL_REDIS_URL": redis_url, "STREAMRL_RUN": run}
    env["HF_DATASETS_CACHE"] = str(cwd / "hf-cache")  # `datasets` writes its cache here
    env["HF_HUB_OFFLINE"] = "1"
    cwd.mkdir(exist_ok=True)
    (cwd / "examples").symlink_to(ROOT / "examples")
    py, lines = _example(title)
    if py:
        done = subprocess.run([sys.executable, "-c", py], cwd=cwd, env=env, capture_output=True)
        assert done.returncode == 0, done.stderr.decode()
    procs = []
    for line in map(edit, lines):
        if line.rstrip().endswith("&"):
            for command in filter(str.strip, line.split("&")):
                procs.append(
                    subprocess.Popen(
                        _argv(command),
                        cwd=cwd,
                        env=env,
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                )
            continue
        done = subprocess.run(_argv(line), cwd=cwd, env=env, capture_output=True, text=True)
        assert done.returncode == 0, (line, done.stdout, done.stderr)
    return procs


def _stop(r, run: str, procs: list) -> None:
    r.set(Keys(run).halt, 1)  # ends the workers' leases
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)


def _completed(r, run: str) -> int:
    return int(r.hget(Keys(run).stats, "groups_completed") or 0)


def test_trl_reward_functions_and_a_saved_dataset(redis_url, r, subprocess_env, tmp_path):
    run = "bring-trl"
    procs = _run_example("TRL reward functions", run, redis_url, subprocess_env, tmp_path)
    try:
        wait_for(
            lambda: _completed(r, run) >= 64,
            "the 64 prompts of easy_add to be scored",
            180,
            every=0.5,
        )
    finally:
        _stop(r, run, procs)
    scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(r, Keys(run).scored)]
    assert len(scores) == 64 * 4 and all(s.reward is not None for s in scores)
    # the scripted policy answers {ground_truth}, or it with " (or so)" added a quarter of
    # the time: both functions score the first 1.0, neither the second
    assert {s.reward for s in scores} == {2.0, 0.0}
    for s in scores:
        assert s.info["reward_functions"] == {
            "exact_answer": s.reward / 2,
            "no_extra_words": s.reward / 2,
        }


def test_openenv_server_and_rollouts(redis_url, r, subprocess_env, tmp_path):
    """The server block runs where openenv-core is installed (tests/support/openenv_server.py
    makes that environment); the example's port 8000 becomes a free one on this shared
    machine, in both blocks."""
    from tests.support.openenv_server import free_port, python_or_skip

    port = str(free_port())
    server_cmd = _blocks("OpenEnv", "bash")[0].strip().replace("8000", port)
    bin_dir = python_or_skip().parent
    env = {**subprocess_env, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)
    server = subprocess.Popen(
        ["bash", "-c", server_cmd],
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / "server.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    run = "bring-openenv"
    procs = []
    try:
        wait_for(lambda: _listening(int(port)), "the OpenEnv server to listen", 60, every=0.2)
        procs = _run_example(
            "OpenEnv", run, redis_url, subprocess_env, tmp_path / "work",
            edit=lambda line: line.replace("8000", port),
        )  # fmt: skip
        wait_for(
            lambda: _completed(r, run) >= 4,
            "the 4 echo prompts to be scored",
            120,
            every=0.5,
        )
    finally:
        _stop(r, run, procs)
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
    scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(r, Keys(run).scored)]
    assert len(scores) == 16
    # the echo environment rewards 0.1 a character of each echoed word
    expected = {"echo-hello": 1.0, "echo-redis": 1.2, "echo-grpo": 1.9, "echo-once": 0.7}
    for s in scores:
        assert s.reward == pytest.approx(expected[s.prompt_id]), s
        assert s.info["server_state"]["step_count"] == s.components["steps"]


def _listening(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port)):
        return True
    return False
