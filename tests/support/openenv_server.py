"""A real OpenEnv server, as openenv-core ships it: the environment ``openenv init`` writes from
the package's own template (an echo environment: ``step({"message"})`` answers the message
and a reward of 0.1 a character), served by the package's ``create_app`` under uvicorn in a
process of its own.

openenv-core 0.3.0 needs openai 3 and mcp 2.3, which the shared venv's other packages pin
differently (``verifiers`` 0.4.0 wants openai < 3 and mcp 2.0), so it lives in a virtualenv of
its own, ``.venv-openenv`` at the repository root, created here on first use (pip from PyPI,
about a minute) and reused after. ``STREAMRL_OPENENV_PYTHON`` names another interpreter that
has openenv-core instead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
VENV = ROOT / ".venv-openenv"
PACKAGE = "openenv-core==0.3.0"
ENV_NAME = "echo_env"


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    """The virtualenv's file lock: parallel test processes build it (and its template) once."""
    with open(ROOT / ".venv-openenv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def python() -> Path:
    """An interpreter with openenv-core, the virtualenv made here if need be (locked, so
    parallel test processes build it once)."""
    given = os.environ.get("STREAMRL_OPENENV_PYTHON")
    if given:
        return Path(given)
    exe = VENV / "bin" / "python"
    ready = VENV / ".ready"
    if ready.exists():
        return exe
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with _locked():
        if not ready.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
            subprocess.run(
                [str(exe), "-m", "pip", "install", "-q", "--disable-pip-version-check", PACKAGE],
                check=True,
            )
            ready.write_text(PACKAGE + "\n")
    return exe


def echo_env(where: Path) -> Path:
    """``openenv init echo_env`` into ``where``: the package's template, unchanged. The CLI
    takes seconds to start, so its output is kept beside the virtualenv and copied."""
    exe = python()
    cached = exe.parent.parent / "streamrl-template" / ENV_NAME
    # locked: two test workers (make test runs two) once wrote the template at the same time
    with _locked():
        if not (cached / "server" / "app.py").exists():
            shutil.rmtree(cached.parent, ignore_errors=True)
            cached.parent.mkdir(parents=True)
            subprocess.run(
                [str(exe.parent / "openenv"), "init", ENV_NAME, "--output-dir",
                 str(cached.parent)],
                check=True,
                capture_output=True,
                env={**os.environ, "PATH": f"{exe.parent}:{os.environ.get('PATH', '')}"},
            )  # fmt: skip
    env_dir = where / ENV_NAME
    shutil.copytree(cached, env_dir, dirs_exist_ok=True)
    return env_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``uvicorn server.app:app`` in the environment's directory, as its README says."""

    def __init__(self, env_dir: Path, port: int | None = None, log: Path | None = None):
        self.env_dir = env_dir
        self.port = port or free_port()
        self.log = log or env_dir.parent / f"openenv-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> Server:
        exe = python()
        out = open(self.log, "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            [str(exe), "-m", "uvicorn", "server.app:app", "--host", "127.0.0.1",
             "--port", str(self.port)],
            cwd=self.env_dir, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text()[-2000:]
                raise RuntimeError(f"the OpenEnv server exited; log: {tail}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return self
            time.sleep(0.1)
        raise TimeoutError(f"the OpenEnv server did not listen in {timeout} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def python_or_skip() -> Path:
    """``python()``, or the test skipped saying why openenv-core could not be installed."""
    import pytest

    try:
        return python()
    except (subprocess.CalledProcessError, OSError) as e:
        pytest.skip(f"openenv-core could not be installed into {VENV}: {e}")
