"""A private ``redis-server`` for runs that were given no Redis URL.

It listens on a free loopback port, keeps its files in the run directory, and is stopped when
the owning process exits. ``durable=True`` turns on the append-only file (``appendfsync
everysec``), so a crashed run can be resumed from what Redis had acknowledged. A durable server
remembers its port in ``redis.port`` and comes back on it, so the URLs that workers were given
stay valid across restarts.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from streamrl.defaults import REDIS_START_TIMEOUT_S


class RedisNotInstalled(RuntimeError):
    pass


_INSTALL_HINT = (
    "streamrl needs a Redis server. Either pass --redis URL (or set STREAMRL_REDIS_URL) to use "
    "an existing one, or install redis-server so streamrl can start a private one: "
    "`apt-get install redis-server` (Debian/Ubuntu), `brew install redis` (macOS), "
    "`conda install -c conda-forge redis`."
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """``with EmbeddedRedis(dir) as r: r.url`` — a redis-server owned by this process."""

    def __init__(self, directory: str | Path, durable: bool = False, port: int | None = None):
        self.directory = Path(directory)
        self.durable = durable
        self.port = port or (self.remembered_port() if durable else None) or free_port()
        self.proc: subprocess.Popen | None = None

    def remembered_port(self) -> int | None:
        """The port a durable server in this directory listened on before, if it is free."""
        try:
            port = int((self.directory / "redis.port").read_text().strip())
        except (OSError, ValueError):
            return None
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return None
        return port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> EmbeddedRedis:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RedisNotInstalled(_INSTALL_HINT)
        self.directory.mkdir(parents=True, exist_ok=True)
        args = [
            exe,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.directory.resolve()),
            "--save", "",
            "--appendonly", "yes" if self.durable else "no",
            "--logfile", "redis.log",
            "--daemonize", "no",
            "--protected-mode", "yes",
        ]  # fmt: skip
        # Own process group: a Ctrl-C on the terminal reaches us, and we stop Redis last.
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + REDIS_START_TIMEOUT_S
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log = self.directory / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server exited at start: {err}{tail}")
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on {self.url} in time")
            time.sleep(0.02)
        client.close()
        # redis.url last, and each file whole: a reader polls for redis.url and must never
        # see it created but still empty (CI once read "" there).
        self._write("redis.pid", f"{self.proc.pid}\n")
        self._write("redis.port", f"{self.port}\n")
        self._write("redis.url", self.url + "\n")
        return self

    def _write(self, name: str, text: str) -> None:
        tmp = self.directory / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.directory / name)

    def kill(self) -> None:
        """SIGKILL the server, as a crash would (no shutdown save, no cleanup); ``start()``
        brings it back on the same port from its AOF."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for name in ("redis.url", "redis.pid"):
            with contextlib.suppress(FileNotFoundError):
                (self.directory / name).unlink()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
