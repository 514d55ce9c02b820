"""The README's promises, checked: its two commands, its example environment (the file, the
README and docs/environments.md agree, and it runs through `streamrl produce` and the workers),
and the CLI's errors. Links and command lines on every page: tests/test_docs.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.local.embedded import EmbeddedRedis, RedisNotInstalled
from tests.support.cli import run_cli
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


_cli = run_cli


def test_readme_commands_and_ci_agree():
    first = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
    assert "make demo" in first and "make test" in first
    ci = (ROOT / ".ci" / "run").read_text()
    assert "\nmake test\n" in ci


@pytest.mark.parametrize("page", ["README.md", "docs/environments.md"])
def test_readme_environment_is_the_example_file(page):
    block = (ROOT / page).read_text().split("This is `examples/reverse_env.py`:", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    assert code == (ROOT / "examples" / "reverse_env.py").read_text()


WORKER = "streamrl.workers.LeaseWorker"


def test_example_environment_runs_through_produce_and_workers(redis_url, r, subprocess_env):
    """The README's commands: audit, produce, then burst rq workers from the repository root."""
    env = {**subprocess_env, "STREAMRL_REDIS_URL": redis_url, "STREAMRL_RUN": "readme"}
    spec = "examples.reverse_env:ReverseEnv"
    out = _cli(["audit", "--env", spec], env)
    assert out.returncode == 0, out.stdout + out.stderr
    out = _cli(["produce", "--env", spec, "--count", "10", "--group-size", "4"], env)
    assert out.returncode == 0, out.stderr
    assert "pushed 10 prompts (40 samples)" in out.stdout
    for queue, stage in (("srl-rollout", "tasks"), ("srl-verify", "rollouts")):
        proc = subprocess.Popen(
            [sys.executable, "-m", "rq.cli", "worker", "-u", redis_url, "-w", WORKER, queue],
            env=env,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:

            def drained(stage: str = stage) -> bool:
                info = json.loads(_cli(["status", "--json"], env).stdout)
                (g,) = info["stages"][stage]["groups"].values()
                return g["lag"] == 0 and g["pending"] == 0 and bool(info["stages"][stage]["length"])

            wait_for(drained, f"the {queue} worker to drain {stage}", 60, every=0.2)
        finally:
            r.set("srl:{readme}:halt", 1)  # ends the worker's lease; rq then stops it
            proc.terminate()
            proc.wait(timeout=60)
            r.delete("srl:{readme}:halt")
    info = json.loads(_cli(["status", "--json"], env).stdout)
    assert info["groups_completed"] == 10 and info["dead_letters"] == 0
    assert info["trajectories"] == 40
    assert _cli(["status"], env).returncode == 0  # the rich table renders too


def test_produce_without_redis_says_what_to_do(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "STREAMRL_REDIS_URL"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "streamrl.cli",
            "--run-dir",
            str(tmp_path),
            "produce",
            "--env",
            "counter",
            "--count",
            "1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "no Redis to talk to" in out.stderr and "streamrl up" in out.stderr


def test_unknown_env_is_a_clear_error(redis_url, subprocess_env):
    env = {**subprocess_env, "STREAMRL_REDIS_URL": redis_url}
    out = _cli(["produce", "--env", "nope", "--count", "1"], env)
    assert out.returncode != 0 and "unknown environment 'nope'" in out.stderr
    assert "counter" in out.stderr  # lists what exists


def test_embedded_redis_without_redis_server_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RedisNotInstalled, match="apt-get install redis-server"):
        EmbeddedRedis(tmp_path / "r").start()


def test_embedded_redis_durable_writes_an_aof(tmp_path):
    with EmbeddedRedis(tmp_path, durable=True) as server:
        import redis

        redis.Redis.from_url(server.url).set("k", "v")
        assert (tmp_path / "redis.url").read_text().strip() == server.url
    assert not (tmp_path / "redis.url").exists()
    assert any(p.name.startswith("appendonly") for p in tmp_path.rglob("*"))


def test_produce_takes_the_run_from_the_config_unless_given(redis_url, subprocess_env, r):
    env = {**subprocess_env, "STREAMRL_REDIS_URL": redis_url}
    env.pop("STREAMRL_RUN", None)
    # the model lives only where the workers run: the producer is told not to look for it
    base = ["produce", "--config", "configs/copy-tiny.toml", "--skip-policy-check"]
    out = _cli([*base, "--count", "2"], env)
    assert out.returncode == 0, out.stderr
    assert r.xlen("srl:{copy-tiny}:tasks") == 16  # group_size 8 from the file
    out = _cli(["--run", "mine", *base, "--count", "1"], env)
    assert out.returncode == 0, out.stderr
    assert r.xlen("srl:{mine}:tasks") == 8


def test_up_stops_its_redis_on_sigterm(tmp_path):
    """`streamrl up &` then `kill %1` must not leave a redis-server behind."""
    import signal

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "--run-dir", str(tmp_path), "up"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert "redis-server on" in proc.stdout.readline()
    pid = int((tmp_path / "redis.pid").read_text())
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    gone = lambda: (  # noqa: E731
        not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    )
    # a process that ends between the two reads counts as not yet: the next poll sees it gone
    wait_for(gone, "redis-server to end (it outlived `streamrl up`)", 10, (FileNotFoundError,))
    assert not (tmp_path / "redis.url").exists()
