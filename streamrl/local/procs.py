"""Starting and stopping real rq worker processes for ``streamrl demo`` and ``bench``; their
process trees and CPU times come from psutil."""

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

import psutil

_WORKER_CLASS = "streamrl.workers.LeaseWorker"
_CONNECTION_CLASS = "streamrl.connection.ResilientRedis"


def rq_worker_cmd(url: str, queue: str, name: str | None = None, quiet: bool = True) -> list[str]:
    """Plain ``rq worker`` with streamrl's worker class (self-healing, JSON serializer) and
    connection class (its first command waits for a Redis that is down)."""
    cmd = [sys.executable, "-m", "rq.cli", "worker", "-u", url, "-w", _WORKER_CLASS, "-S", "json"]
    cmd += ["--connection-class", _CONNECTION_CLASS]
    cmd.append(queue)
    if name:
        cmd += ["--name", name]
    if quiet:
        cmd.append("-q")
    return cmd


def at_nice(cmd: list[str], nice: int | None) -> list[str]:
    """``cmd`` to be started at nice value ``nice`` (through ``nice -n``, so that the value is
    set before the program starts its first thread); unchanged where ``nice`` is None or not
    above this process's own (lowering it takes privileges)."""
    if nice is None:
        return cmd
    step = nice - os.getpriority(os.PRIO_PROCESS, 0)
    return ["nice", "-n", str(step), *cmd] if step > 0 else cmd


def lower_priority(pid: int, nice: int) -> None:
    """Give every thread of ``pid`` the nice value ``nice`` (on Linux a nice value is per
    thread); the threads and processes it starts later inherit it. Nothing happens where the
    process is gone or the system refuses (a nice value can only be raised unprivileged)."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, pid, nice)  # the whole process where it is per process
    try:
        tids = [t.id for t in psutil.Process(pid).threads()]
    except psutil.Error:
        return
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, nice)


def role_of(title: str) -> str:
    """What a process of a local pipeline is, from its command line or title (``ps``): learner,
    worker (an rq worker or work horse), redis, prefork (the demo's fork server) or other."""
    if "streamrl.cli learn" in title:
        return "learner"
    if title.startswith("rq:") or "rq.cli" in title:
        return "worker"
    if "redis-server" in title:
        return "redis"
    if title.startswith("streamrl prefork server"):
        return "prefork"
    return "other"


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (none once it is gone)."""
    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


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
        # the nice value workers it starts with `subprocess.Popen` are born at (a launcher
        # sets its own)
        self.nice: int | None = None

    def start(self, queue: str, n: int, prefix: str = "",
              env: dict[str, str] | None = None) -> list[subprocess.Popen]:  # fmt: skip
        """``env``: variables these workers get besides ``self.env``."""
        started = []
        proc_env = self.env
        if env:
            proc_env = {**(self.env if self.env is not None else os.environ), **env}
        for _ in range(n):
            name = f"{prefix or queue}-{len(self.procs)}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            log = None
            if self.log_dir is not None:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                log = self.log_dir / f"{name}.log"
            cmd = rq_worker_cmd(self.control_url, queue, name)
            if self.launcher is not None:
                p = self.launcher(cmd, log, proc_env)
            else:
                p = subprocess.Popen(
                    at_nice(cmd, self.nice),
                    stdout=open(log, "ab") if log else subprocess.DEVNULL,  # noqa: SIM115
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env=proc_env,
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


def _family(roots: list[int]) -> list[psutil.Process]:
    """``roots`` and all their descendants, each once (those still alive)."""
    found: dict[int, psutil.Process] = {}
    for pid in roots:
        try:
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                found.setdefault(p.pid, p)
        except psutil.NoSuchProcess:
            continue
    return list(found.values())


def _cpu(p: psutil.Process, children: bool) -> float:
    """``p``'s CPU seconds, with those of its reaped children (cutime, cstime) if asked; 0 once
    it is gone."""
    try:
        t = p.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return t.user + t.system + (t.children_user + t.children_system if children else 0.0)


def tree_cpu(roots: list[int]) -> float:
    """CPU seconds used by ``roots`` and all their descendants, living or reaped (a reaped
    child's time is in its parent's cutime/cstime)."""
    return sum(_cpu(p, children=True) for p in _family(roots))


def tree_rss(roots: list[int]) -> int:
    """Resident bytes of ``roots`` and all their living descendants."""
    total = 0
    for p in _family(roots):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


def own_cpu(pid: int) -> float:
    """CPU seconds ``pid`` itself used (not its children's)."""
    try:
        return _cpu(psutil.Process(pid), children=False)
    except psutil.NoSuchProcess:
        return 0.0


def self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime
