"""A fork server for ``streamrl demo``'s roles: torch and transformers imported once.

Each of the demo's torch processes (two rollout workers, the learner, the model builder) used
to import torch and transformers on its own: about 7.5 s of CPU each, four of them at once on
a two-core machine, so the learner's first step came about 20 s after launch. Forked from one
process that has paid those imports, each role starts in a fraction of a second.

The children run the very programs a user starts by hand (``rq worker ...``,
``streamrl learn ...``): the same argv, run by ``runpy`` as ``python -m`` would. Only the
import cost is shared. The server is the standard library's ``forkserver``: it forks from a
single-threaded process, so the children are as safe as rq's own work horses, which are forked
from a worker that has imported torch too. ``STREAMRL_PREFORK=0`` turns it off (each role
then starts as its own ``python -m`` process).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import shlex
import signal
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
from setproctitle import setproctitle, setthreadtitle

# What the roles import before their first useful line; a module missing here is simply
# imported by the child (the server skips what fails to import).
_PRELOAD = [
    "streamrl.local.prefork_server",  # names the server in `ps`
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.generation",
    "rq.cli",
    "streamrl.cli",
    "streamrl.models.tiny",
    "streamrl.policy.hf",
    "streamrl.workers.rollout",
    "streamrl.cli.learn",
]


# one thread per process: the demo's learner and two rollout workers share a laptop's cores
# (set before torch is imported, so in the server's environment)
THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# the ``streamrl`` group's options that take a value (``--opt value``), for ``demo_argv``
_VALUE_OPTIONS = {"--redis", "--control-redis", "--run", "--run-dir", "--log-format"}

_early: Prefork | None = None  # started by ``start_early``, taken by the demo


def enabled() -> bool:
    return os.environ.get("STREAMRL_PREFORK", "1") != "0"


def demo_argv(argv: list[str]) -> bool:
    """Whether ``argv`` runs ``streamrl demo`` (by its script or ``python -m streamrl.cli``,
    where ``argv[0]`` is ``-m`` while the package is imported), and not its ``--help``."""
    if not argv or os.path.basename(argv[0]) not in ("-m", "streamrl"):
        return False
    args, i = argv[1:], 0
    while i < len(args):  # the group's options, then the command
        if not args[i].startswith("-"):
            return args[i] == "demo" and "--help" not in args[i + 1 :]
        i += 2 if args[i] in _VALUE_OPTIONS else 1
    return False


def start_early(argv: list[str]) -> None:
    """Start the demo's fork server now when ``argv`` runs the demo. Called before the command
    line imports its own modules (~0.35 s on one core): the server's torch and transformers
    imports (~3.3 s) are the demo's start-up critical path, and the other core is free for the
    command line meanwhile. A server no demo takes ends with this process."""
    global _early
    if _early is None and enabled() and demo_argv(argv):
        _early = Prefork(env=THREADS)


def take_early() -> Prefork | None:
    """The server ``start_early`` started (once), or None."""
    global _early
    forks, _early = _early, None
    return forks


@contextlib.contextmanager
def _environ(extra: dict[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Forked:
    """``subprocess.Popen``'s surface (pid, poll, wait, send_signal, kill) for a process forked
    by the server, so the demo and ``procs`` handle both kinds alike.

    The exit status comes through the server; a server that is gone (a signal to the demo's
    whole process group reaches it, while the workers sit in sessions of their own) reports
    every child as exited with 255. The child is then followed by its PID (psutil checks it
    is the same process), so a caller still stops, and waits for, what is alive."""

    def __init__(self, proc: Any, args: list[str]):
        self._proc = proc
        self.args = args
        try:
            self._ps: psutil.Process | None = psutil.Process(proc.pid)
        except psutil.NoSuchProcess:  # already gone (and reaped by the server)
            self._ps = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def _orphan_alive(self) -> bool:
        """Whether the child outlived the server that forked it."""
        if self._ps is None:
            return False
        try:
            return self._ps.is_running() and self._ps.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def poll(self) -> int | None:
        code = self._proc.exitcode
        if code is None or self._orphan_alive():
            return None
        return code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._proc.join(timeout)
        while self.poll() is None:  # an orphan: reaped by init, watched here by PID
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.05)
        return self._proc.exitcode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _child(
    argv: list[str], env: dict[str, str], log: str | None, new_session: bool, nice: int | None
) -> None:
    """In the forked child: become ``python -m <module> <args>`` with ``env``, writing to
    ``log``, at nice value ``nice`` (its one thread now: every later one inherits it)."""
    if nice is not None:
        with contextlib.suppress(OSError):  # only raised unprivileged, as lower_priority
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    if new_session:
        os.setsid()
    fd = os.open(log or os.devnull, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # `ps` shows the role, not the fork server's command line. (Before the environment is
    # replaced: setproctitle finds the end of the argv area from the original environ.)
    setproctitle(shlex.join(argv))
    setthreadtitle(os.path.basename(argv[0])[:15])  # `comm` (top's name) as a spawned one has it
    os.environ.clear()
    os.environ.update(env)
    _as_if_spawned()
    module = argv[2]
    sys.argv = [module, *argv[3:]]
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` has it
    runpy.run_module(module, run_name="__main__", alter_sys=True)


@contextlib.contextmanager
def _without_main() -> Iterator[None]:
    """Start children without the caller's ``__main__``: multiprocessing would re-import it
    in each child (as ``__mp_main__``), and a script that calls the demo without an
    ``if __name__ == "__main__"`` guard would run again there. The children run
    ``streamrl.local.prefork`` functions and need nothing from it."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _as_if_spawned() -> None:
    """Undo what the fork server's child inherits but a ``python -m`` process would not have:
    forkserver as the default start method (with it, tqdm's lock in transformers became a
    named semaphore, and every role killed at the end left one behind, with a warning), and
    the collector the server turned off. The inherited imports are frozen first: a full
    collection no longer walks them (it took 0.2-0.35 s each, a few times a run, in the
    learner's critical path) nor writes to their shared pages."""
    multiprocessing.set_start_method(None, force=True)
    gc.freeze()
    gc.enable()


def _call(fn: Callable[..., Any], args: tuple) -> None:
    _as_if_spawned()
    fn(*args)


class Prefork:
    """Start ``python -m`` commands as children of one fork server that has imported
    ``_PRELOAD``. ``env`` is the server's environment (thread counts must be set before torch
    is imported); each child gets its own."""

    def __init__(self, env: dict[str, str] | None = None):
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(_PRELOAD)
        with _environ(env or {}):
            multiprocessing.forkserver.ensure_running()  # returns at once; imports go on

    @property
    def server_pid(self) -> int | None:
        return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)

    def popen(
        self,
        argv: list[str],
        log: str | Path | None = None,
        env: dict[str, str] | None = None,
        new_session: bool = False,
        nice: int | None = None,
    ) -> Forked:
        """Like ``subprocess.Popen(argv, stdout=log, stderr=STDOUT, env=env)`` for an argv of
        the form ``[python, "-m", module, *args]``; blocks until the server has forked (the
        first call waits for its imports). ``nice``: the child's nice value, set before it runs
        anything (a child of the server starts its threads within milliseconds, before a
        caller could lower them)."""
        if argv[1:2] != ["-m"]:
            raise ValueError(f"prefork runs `python -m module ...` commands, not {argv[:3]}")
        env = dict(os.environ if env is None else env)
        proc = self._ctx.Process(
            target=_child,
            args=(argv, env, str(log) if log else None, new_session, nice),
            daemon=False,
        )
        with _without_main():
            proc.start()
        return Forked(proc, argv)

    def stop(self) -> None:
        """End the server now. A fork asked of it while it still imports is served once the
        imports are done, even after the asker gave up: a demo interrupted in its first
        seconds had its model written into a directory it had already removed. The children
        it has forked live on; a later ``popen`` starts a new server."""
        pid = self.server_pid
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        forget = getattr(multiprocessing.forkserver._forkserver, "_stop", None)
        if forget is not None:  # the standard library's own: reaps it, forgets its socket
            forget()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> None:
        """Run ``fn(*args)`` in a forked child (one that needs the preloaded imports) and
        wait for it."""
        proc = self._ctx.Process(target=_call, args=(fn, args))
        with _without_main():
            proc.start()
        try:
            proc.join(timeout)
        except BaseException:  # Ctrl-C or `kill` at start-up: the caller removes its files
            proc.kill()  # next, which this child would still be writing
            proc.join(5)
            raise
        if proc.exitcode != 0:
            if proc.exitcode is None:
                proc.kill()
            raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in the fork server")
