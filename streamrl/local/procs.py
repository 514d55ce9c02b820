"""Starting and stopping real rq worker processes for ``streamrl demo`` and ``bench``."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER_CLASS = "streamrl.workers.LeaseWorker"


def rq_worker_cmd(url: str, queue: str, name: str | None = None, quiet: bool = True) -> list[str]:
    """Plain ``rq worker`` with streamrl's worker class (self-healing, JSON serializer)."""
    cmd = [sys.executable, "-m", "rq.cli", "worker", "-u", url, "-w", WORKER_CLASS, "-S", "json"]
    cmd.append(queue)
    if name:
        cmd += ["--name", name]
    if quiet:
        cmd.append("-q")
    return cmd


def _stat(pid: int | str) -> list[str] | None:
    """``/proc/PID/stat``'s fields after the command name (field 1 is the parent pid, 11..14
    the CPU times), or None when the process is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()


def proc_table() -> tuple[dict[int, list[int]], dict[int, list[str]]]:
    """Every process in /proc: children by parent pid, and each pid's ``_stat`` fields."""
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or (fields := _stat(entry.name)) is None:
            continue
        pid = int(entry.name)
        stats[pid] = fields
        children.setdefault(int(fields[1]), []).append(pid)
    return children, stats


def tree(roots: list[int], children: dict[int, list[int]]) -> list[int]:
    """``roots`` and all their descendants, each once."""
    out, stack, seen = [], list(roots), set()
    while stack:
        pid = stack.pop()
        if pid in seen:
            continue
        seen.add(pid)
        out.append(pid)
        stack += children.get(pid, [])
    return out


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid``."""
    children, _ = proc_table()
    return tree([pid], children)[1:]


def stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM each process and its descendants (newest first), SIGKILL what is left after
    ``grace_s``. The families are collected by PID first: rq puts its work horses in sessions
    of their own, and a warm shutdown would wait out a long lease."""
    family = {p.pid: [p.pid, *descendants(p.pid)] for p in procs}

    def send(pids: list[int], sig: int) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    for p in reversed(procs):
        send(family[p.pid], signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        send(family[p.pid], signal.SIGKILL)
        p.wait()


class WorkerProcs:
    """rq workers, each in its own process group so that a kill takes its work horse too."""

    def __init__(
        self,
        url: str,
        log_dir: str | Path | None = None,
        env: dict | None = None,
        control_url: str | None = None,
    ):
        """``url`` is the runs' data Redis; ``control_url`` rq's, when that is another server
        (a plain Redis beside a Redis Cluster): the workers then get the data URL as
        ``STREAMRL_DATA_URL``."""
        self.url = url
        self.control_url = control_url or url
        self.log_dir = Path(log_dir) if log_dir else None
        self.env = env
        if self.control_url != url:
            from streamrl.connection import ENV_DATA_URL

            self.env = {**(env if env is not None else os.environ), ENV_DATA_URL: url}
        self.procs: list[tuple[str, subprocess.Popen]] = []
        # how a worker process is started: `subprocess.Popen` unless set (the demo forks its
        # torch workers from a fork server, streamrl.local.prefork); (argv, log, env) -> Popen-like
        self.launcher: Callable[[list[str], Path | None, dict | None], Any] | None = None

    def start(self, queue: str, n: int, prefix: str = "") -> list[subprocess.Popen]:
        started = []
        for _ in range(n):
            name = f"{prefix or queue}-{len(self.procs)}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            log = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                log = self.log_dir / f"{name}.log"
            cmd = rq_worker_cmd(self.control_url, queue, name)
            if self.launcher is not None:
                p = self.launcher(cmd, log, self.env)
            else:
                p = subprocess.Popen(
                    cmd,
                    stdout=open(log, "ab") if log else subprocess.DEVNULL,  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=self.env,
                )
            self.procs.append((name, p))
            started.append(p)
        return started

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Signal the worker and every descendant: rq starts its work horse in a session of
        its own, so the worker's process group alone would miss it."""
        for pid in [proc.pid, *descendants(proc.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def stop(self, timeout: float = 10.0) -> None:
        """Warm shutdown (rq lets the lease finish), then SIGKILL whatever is left."""
        for _, p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
        for _, p in self.procs:
            if p.poll() is None:
                self.kill(p, signal.SIGKILL)
                p.wait()
        self.procs.clear()


_TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(roots: list[int]) -> float:
    """CPU seconds used by ``roots`` and all their descendants, living or reaped (a reaped
    child's time is in its parent's cutime/cstime)."""
    children, stats = proc_table()
    return sum(
        sum(int(x) for x in stats[pid][11:15]) / _TICK  # utime stime cutime cstime
        for pid in tree(roots, children)
        if pid in stats
    )


def own_cpu(pid: int) -> float:
    """CPU seconds ``pid`` itself used (not its children's)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / _TICK if fields else 0.0


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
