"""Run untrusted Python in a separate, limited process.

What one run gets (Linux):

- rlimits: CPU seconds (RLIMIT_CPU, SIGXCPU then SIGKILL one second later), address space
  (RLIMIT_AS), processes (RLIMIT_NPROC), file size (RLIMIT_FSIZE), no core dumps;
- a wall-clock timeout that kills the whole process group, and a capped stdout/stderr (more
  output than the cap kills the run: ``limit_hit="output"``);
- a fresh temporary working directory, removed afterwards, and a cleared environment (the
  interpreter runs with ``-I``: no PYTHON* variables, no user site, no script dir on sys.path);
- no network: a new network namespace with nothing in it, when the OS allows one
  (``network_isolated`` says whether it was applied).

When streamrl runs as **root** (the usual container case) each run also gets its own
unprivileged uid from ``SANDBOX_UID_BASE``. That matters: the kernel does not enforce
RLIMIT_NPROC for root, and it counts processes per uid, so a shared uid such as ``nobody``
would let concurrent runs starve each other. With its own uid the run cannot write anything
root owns (the repository, the caller's cwd, /root), cannot read other processes'
``/proc/<pid>/environ``, and every process it left behind, even one that escaped the process
group with ``setsid``, is found by uid and killed. Root also gives the run a private mount
namespace with empty, size-capped tmpfs mounts over /tmp, /var/tmp, /dev/shm and /run/lock,
so files written "outside" land in a scratch space that disappears with the run.

Not root: no uid switch, so RLIMIT_NPROC counts all of the user's processes (we allow the
user's current count plus ``max_procs``), the program can write wherever the user can, and
network isolation needs unprivileged user namespaces.

``limit_hit`` is a diagnosis: wall, output and CPU come from what the parent saw; memory,
file size and processes are read off the program's own error (MemoryError, EFBIG, EAGAIN)
and so are hints a program could fake, never a security signal.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

import msgspec

from streamrl import defaults

LimitHit = Literal["wall", "cpu", "memory", "file_size", "processes", "output"]

_LAUNCHER = str(Path(__file__).with_name("_sandbox_launch.py"))


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): a verifier failure, never a reward."""


class SandboxResult(msgspec.Struct, kw_only=True):
    exit_code: int  # negative: killed by that signal
    stdout: str
    stderr: str
    timed_out: bool = False
    limit_hit: LimitHit | None = None
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    network_isolated: bool = False
    private_tmp: bool = False
    uid: int | None = None  # the unprivileged uid the program ran as, None if not switched
    notes: list[str] = []  # isolation this OS would not give us

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit_hit is None


# ---------------------------------------------------------------- the interpreter


def _world_usable(path: str) -> bool:
    """Can an unrelated uid execute ``path`` and traverse every directory above it?"""
    p = Path(path)
    try:
        if not p.stat().st_mode & stat.S_IXOTH:
            return False
        return all(d.stat().st_mode & stat.S_IXOTH for d in p.parents)
    except OSError:
        return False


def _find_python(for_other_uid: bool) -> str:
    """Our own interpreter when the sandbox uid can use it, else a system python3.

    A pyenv or venv under /root (mode 0700) is unreachable once we drop to another uid."""
    own = os.path.realpath(sys.executable)
    stdlib = sysconfig.get_paths()["stdlib"]
    if not for_other_uid or (_world_usable(own) and _world_usable(stdlib + "/os.py")):
        return own
    for candidate in ("/usr/local/bin/python3", "/usr/bin/python3", "/bin/python3"):
        real = os.path.realpath(candidate)
        if os.path.exists(real) and _world_usable(real):
            return real
    raise SandboxError(f"no python interpreter usable by an unprivileged uid (own: {own})")


# ---------------------------------------------------------------- processes of a uid
# Our own /proc reader, not psutil (which streamrl.local uses): the owner of /proc/<pid> is the
# process's effective uid, so one stat() per entry finds a sandbox uid's processes without
# opening and parsing each /proc/<pid>/status. It runs every 5 ms in the kill loop until the
# uid has nothing left, and once per pass of ``_pick_uid``.


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True  # gone


def _pids_of_uid(uid: int) -> list[int]:
    """Live processes running as ``uid`` (zombies hold nothing and cannot be killed)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid and not _is_zombie(int(entry.name)):
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def _pick_uid() -> int:
    for _ in range(32):
        uid = defaults.SANDBOX_UID_BASE + secrets.randbelow(defaults.SANDBOX_UID_COUNT)
        try:
            pwd.getpwuid(uid)
            continue  # a real account: not ours to use
        except KeyError:
            pass
        if not _pids_of_uid(uid):
            return uid
    raise SandboxError("no free sandbox uid")


def _kill_all(pgid: int, uid: int | None) -> None:
    """Kill the process group, then (with a sandbox uid) everything running as that uid, until
    nothing is left: processes that called setsid escaped the group but not their uid."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    if uid is None:
        return
    for _ in range(200):
        pids = _pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _user_process_count() -> int:
    return len(_pids_of_uid(os.getuid()))


# ---------------------------------------------------------------- running


def _classify(status: int, stderr: str, cpu: float, cpu_s: float) -> tuple[int, LimitHit | None]:
    code = os.waitstatus_to_exitcode(status)
    if code in (-signal.SIGXCPU,) or (code == -signal.SIGKILL and cpu >= cpu_s - 0.05):
        return code, "cpu"
    if code == -signal.SIGXFSZ:
        return code, "file_size"
    if code == 0:
        return code, None
    tail = stderr[-2000:]
    if "File too large" in tail or "[Errno 27]" in tail:
        return code, "file_size"
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return code, "memory"
    if "Resource temporarily unavailable" in tail or "[Errno 11]" in tail:
        return code, "processes"
    return code, None


def _read_status(fd: int, deadline: float) -> dict:
    buf = b""
    with os.fdopen(fd, "rb", buffering=0) as f:
        sel = selectors.DefaultSelector()
        sel.register(f, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            chunk = f.read(4096)
            if not chunk:
                break
            buf += chunk
        sel.close()
    lines = [json.loads(x) for x in buf.decode().splitlines() if x.strip()]
    for line in lines:
        if "error" in line:
            raise SandboxError(f"sandbox setup failed: {line['error']}")
    if not lines:
        raise SandboxError("sandbox launcher reported nothing")
    return lines[0]


def run_python(
    program: str | os.PathLike[str],
    *,
    timeout_s: float = defaults.SANDBOX_TIMEOUT_S,
    memory_mb: int = defaults.SANDBOX_MEMORY_MB,
    cpu_s: float | None = None,
    max_procs: int = defaults.SANDBOX_MAX_PROCS,
    max_file_mb: int = defaults.SANDBOX_MAX_FILE_MB,
    stdin: str | bytes | None = None,
    files: dict[str, str | bytes] | None = None,
    args: list[str] | None = None,
    max_output_bytes: int = defaults.SANDBOX_MAX_OUTPUT_BYTES,
    isolate_network: bool = True,
) -> SandboxResult:
    """Run ``program`` (source text, or a path to a .py file) as ``main.py`` in a fresh
    working directory next to ``files``; see the module docstring for what is enforced."""
    source = Path(program).read_text() if isinstance(program, os.PathLike) else program
    cpu_limit = int(max(1, round(cpu_s if cpu_s is not None else timeout_s)))
    as_root = os.geteuid() == 0
    uid = _pick_uid() if as_root else None
    python = _find_python(for_other_uid=uid is not None)
    workdir = tempfile.mkdtemp(prefix="srl-sandbox-")
    try:
        for name, content in {**(files or {}), "main.py": source}.items():
            target = Path(workdir, name)
            if target.resolve().parent != Path(workdir).resolve():
                raise ValueError(f"sandbox file names must be plain names, got {name!r}")
            target.write_bytes(content.encode() if isinstance(content, str) else content)
        if uid is not None:
            for p in [workdir, *(str(Path(workdir, n)) for n in os.listdir(workdir))]:
                os.chown(p, uid, uid)
        nproc = max_procs if uid is not None else _user_process_count() + max_procs
        status_r, status_w = os.pipe()
        cfg = {
            "status_fd": status_w,
            "workdir": workdir,
            "uid": uid,
            "gid": uid,
            "isolate_network": isolate_network,
            "private_tmp": list(defaults.SANDBOX_PRIVATE_TMP),
            "tmp_mb": max_file_mb,
            "rlimits": {
                "RLIMIT_CPU": [cpu_limit, cpu_limit + 1],
                "RLIMIT_AS": [memory_mb << 20, memory_mb << 20],
                "RLIMIT_NPROC": [nproc, nproc],
                "RLIMIT_FSIZE": [max_file_mb << 20, max_file_mb << 20],
                "RLIMIT_CORE": [0, 0],
            },
            "argv": [python, "-I", "main.py", *(args or [])],
            "env": {
                "PATH": "/usr/local/bin:/usr/bin:/bin",
                "HOME": workdir,
                "LANG": "C.UTF-8",
                "PYTHONIOENCODING": "utf-8",
            },
        }
        # stdin from a file, not a pipe: no deadlock however much the program ignores it
        with tempfile.TemporaryFile() as stdin_file:
            if stdin is not None:
                stdin_file.write(stdin.encode() if isinstance(stdin, str) else stdin)
                stdin_file.seek(0)
            return _supervise(cfg, status_r, status_w, stdin_file, timeout_s, max_output_bytes)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class _Run:
    """What the parent has seen of one run so far."""

    def __init__(self, proc: subprocess.Popen, uid: int | None):
        self.proc = proc
        self.uid = uid
        self.out: dict[Any, bytearray] = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        self.status: int | None = None  # the wait status, once the program has exited
        self.usage: Any = None  # its rusage, with the status
        self.timed_out = False
        self.over = False  # more output than the cap


def _supervise(
    cfg: dict, status_r: int, status_w: int, stdin_file, timeout_s: float, cap: int
) -> SandboxResult:
    """Launch, read the output, kill and reap whatever is left (always), then judge."""
    start = time.monotonic()
    run = _Run(_launch(cfg, status_r, status_w, stdin_file), cfg["uid"])
    try:
        report = _read_status(status_r, start + 10.0)
        _collect(run, start + timeout_s, cap)
    finally:
        _reap(run)
    return _result(run, report, cfg["rlimits"]["RLIMIT_CPU"][0], cap, start)


def _launch(cfg: dict, status_r: int, status_w: int, stdin_file) -> subprocess.Popen:
    """Start the launcher in a session of its own; the parent keeps only the status pipe's read
    end (closed too if the start fails)."""
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", _LAUNCHER, json.dumps(cfg)],
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(status_w,),
            start_new_session=True,
            env={},
            cwd=cfg["workdir"],
        )
    except BaseException:
        os.close(status_r)
        raise
    finally:
        os.close(status_w)


def _collect(run: _Run, deadline: float, cap: int) -> None:
    """Read stdout and stderr until both close, the wall deadline passes or one exceeds the
    cap. Once the program exits, whatever it left behind is killed: it would hold the pipes
    open."""
    with selectors.DefaultSelector() as sel:
        for f in run.out:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map():
            if run.status is None:
                pid, st, ru = os.wait4(run.proc.pid, os.WNOHANG)
                if pid:
                    run.status, run.usage = st, ru
                    _kill_all(run.proc.pid, run.uid)
            if run.status is None and time.monotonic() >= deadline:
                run.timed_out = True
                return
            for key, _ in sel.select(timeout=0.05):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                run.out[key.fileobj] += chunk
                if len(run.out[key.fileobj]) > cap:
                    run.over = True
            if run.over:
                return


def _reap(run: _Run) -> None:
    """Kill everything the run left, wait for the program (if it has not exited yet) and close
    its pipes."""
    _kill_all(run.proc.pid, run.uid)
    if run.status is None:
        _, run.status, run.usage = os.wait4(run.proc.pid, 0)
    run.proc.returncode = os.waitstatus_to_exitcode(run.status)
    for f in run.out:
        f.close()


def _result(run: _Run, report: dict, cpu_limit: float, cap: int, start: float) -> SandboxResult:
    assert run.status is not None
    cpu = run.usage.ru_utime + run.usage.ru_stime if run.usage else 0.0
    stdout = run.out[run.proc.stdout][:cap].decode(errors="replace")
    stderr = run.out[run.proc.stderr][:cap].decode(errors="replace")
    code, limit = _classify(run.status, stderr, cpu, cpu_limit)
    if run.over:
        limit = "output"
    if run.timed_out:
        limit = "wall"
    return SandboxResult(
        exit_code=code,
        stdout=stdout,
        stderr=stderr,
        timed_out=run.timed_out,
        limit_hit=limit,
        seconds=round(time.monotonic() - start, 4),
        cpu_seconds=round(cpu, 4),
        network_isolated=report.get("network") is not None,
        private_tmp=bool(report.get("private_tmp")),
        uid=report.get("uid") if run.uid is not None else None,
        notes=report.get("notes", []),
    )
