"""Logs: JSON lines or a console renderer by flag or environment variable, the same keys in
every role, and an error that repeats on every batch (a failing policy reload) written once."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys

import pytest

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig
from streamrl.log import Repeats, configure, log_format
from streamrl.models.tiny import save_tiny
from streamrl.schema import PolicyVersion, encode
from tests.support.cli import ROOT


@pytest.fixture
def restore_structlog():
    """configure() binds the stream it writes to (capsys's here): put the old setup back."""
    import structlog

    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def _first_line(argv: list[str], env: dict) -> str:
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", *argv],
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        return proc.stderr.readline()  # type: ignore[union-attr]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_format_by_flag_and_by_environment(redis_url, subprocess_env):
    env = {**subprocess_env, "STREAMRL_REDIS_URL": redis_url, "STREAMRL_RUN": "logs"}
    argv = ["metrics", "--port", "0", "--addr", "127.0.0.1"]
    line = _first_line(["--log-format", "json", *argv], env)
    rec = json.loads(line)
    assert rec["event"] == "serving metrics" and rec["level"] == "info"
    assert rec["run"] == "logs" and rec["role"] == "metrics" and rec["worker"]
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", rec["url"])
    console = _first_line(argv, {**env, "STREAMRL_LOG_FORMAT": "console"})
    with pytest.raises(json.JSONDecodeError):
        json.loads(console)
    assert "serving metrics" in console and "role=metrics" in console and "run=logs" in console
    bad = subprocess.run(
        [sys.executable, "-m", "streamrl.cli", "status"],
        env={**env, "STREAMRL_LOG_FORMAT": "xml"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "'xml' is not one of" in bad.stderr


def test_auto_format_follows_the_terminal(monkeypatch):
    monkeypatch.delenv("STREAMRL_LOG_FORMAT", raising=False)
    assert log_format() == ("console" if sys.stderr.isatty() else "json")
    monkeypatch.setenv("STREAMRL_LOG_FORMAT", "console")
    assert log_format() == "console" and log_format("json") == "json"
    with pytest.raises(ValueError, match="expected one of auto, json, console"):
        log_format("yaml")


def test_repeats_writes_first_changed_and_then_once_per_window():
    rep = Repeats(every_s=60)
    assert rep.check("k", "boom", now=0) == 0
    assert [rep.check("k", "boom", now=t) for t in range(1, 30)] == [None] * 29
    assert rep.check("k", "other error", now=31) == 0  # a different error is news
    assert rep.check("k", "other error", now=32) is None
    assert rep.check("k", "other error", now=91) == 1  # once a window, with what it left out
    rep.clear("k")
    assert rep.check("k", "other error", now=92) == 0


def test_failing_policy_reload_is_logged_once_not_per_batch(
    redis_url, r, tmp_path, capsys, monkeypatch, restore_structlog
):
    """The hf backend retries a bad version at every check (here: every batch); its error
    goes to the log once, with the standard keys, and the recovery once."""
    from safetensors.torch import save_file

    from streamrl.models.tiny import build_model
    from streamrl.policy.hf import HFPolicy

    monkeypatch.setenv("STREAMRL_LOG_FORMAT", "json")
    configure()
    model = save_tiny(tmp_path / "tiny")
    policy = HFPolicy(
        PolicyConfig(backend="hf", model=str(model), options={"reload_check_s": 0}),
        None,
        redis_url=redis_url,
        run="reload",
    )
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"not safetensors")
    good = tmp_path / "good"
    good.mkdir()
    save_file(
        {k: v.contiguous() for k, v in build_model(seed=3).state_dict().items()},
        good / "model.safetensors",
    )

    def announce(version, path):
        pv = PolicyVersion(version=version, step=version, path=str(path))
        r.xadd(Keys("reload").policy, {"p": encode(pv)})

    async def main():
        announce(1, bad)
        for _ in range(25):  # 25 batches' worth of reload checks
            await policy.refresh()
        errors = policy.reload_error
        announce(2, good)
        await policy.refresh()
        await policy.close()
        return errors

    assert asyncio.run(main()) is not None
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    failed = [x for x in lines if x["event"] == "policy reload failed"]
    assert len(failed) == 1, failed
    assert failed[0]["level"] == "error" and failed[0]["policy_version"] == 0
    assert {"run", "role", "worker"} <= set(failed[0])
    reloaded = [x for x in lines if x["event"] == "policy reloaded"]
    assert len(reloaded) == 1 and reloaded[0]["policy_version"] == 2
