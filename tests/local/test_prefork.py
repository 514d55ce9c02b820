"""The demo's fork server: a forked role runs the same `python -m` program as a spawned one,
with its own argv, env and log, and behaves like a Popen to whoever stops it."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.local.prefork import Forked, Prefork, demo_argv
from streamrl.local.procs import descendants
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def forks():
    return Prefork()


def _argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "tests.support.prefork_child", *args]


def test_child_runs_the_module_with_its_argv_env_and_log(forks, tmp_path):
    log = tmp_path / "child.log"
    p = forks.popen(_argv("exit", "3"), log, env={"PREFORK_TEST": "yes"})
    assert isinstance(p, Forked)
    assert p.wait(timeout=60) == 3 and p.returncode == 3
    text = log.read_text()
    assert "argv=['exit', '3'] env=yes torch=True" in text, text  # torch came from the server
    assert "session_leader=False" in text
    assert "nice=0" in text


def test_a_child_is_born_at_its_nice_value(forks, tmp_path):
    """Set in the child before it runs the module: a caller lowering it after the fork would be
    late for the threads a preloaded role starts in its first milliseconds."""
    log = tmp_path / "child.log"
    p = forks.popen(_argv("exit", "0"), log, env={}, nice=7)
    assert p.wait(timeout=60) == 0
    assert "nice=7" in log.read_text()
    assert os.getpriority(os.PRIO_PROCESS, forks.server_pid or 0) == 0  # the server as it was


def test_a_child_collects_garbage_but_not_among_the_servers_imports(forks, tmp_path):
    """The server imports with the collector off; a child turns it on with what it inherited
    frozen, so a full collection does not walk torch's and transformers' objects."""
    log = tmp_path / "child.log"
    p = forks.popen(_argv("exit", "0"), log, env={})
    assert p.wait(timeout=60) == 0
    gc_line = next(line for line in log.read_text().splitlines() if line.startswith("gc="))
    enabled, frozen = gc_line.split()
    assert enabled == "gc=True", gc_line
    assert int(frozen.removeprefix("frozen=")) > 100_000, gc_line  # torch alone leaves more


def test_new_session_and_signals_reach_the_child(forks, tmp_path):
    log = tmp_path / "child.log"
    p = forks.popen(_argv("wait"), log, env={}, new_session=True)
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.5)
    assert p.poll() is None
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert "session_leader=True" in log.read_text()
    assert p.pid not in descendants(forks.server_pid or 0)


def test_ps_shows_the_role_not_the_fork_server(forks, tmp_path):
    log = tmp_path / "child.log"
    p = forks.popen(_argv("wait"), log, env={})
    try:

        def started() -> bool:
            if "argv=" in (log.read_text() if log.exists() else ""):
                return True
            assert p.poll() is None, "the child did not start"
            return False

        wait_for(started, "the child to start", 60)
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes().replace(b"\0", b" ").strip()
        assert cmdline.decode() == shlex.join(_argv("wait"))
        comm = Path(f"/proc/{p.pid}/comm").read_text().strip()
        assert comm == Path(sys.executable).name[:15]
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)


def test_ps_names_the_fork_server_and_its_owner(forks):

    def shown() -> str:
        pid = forks.server_pid
        return Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode() if pid else ""

    def named() -> str:
        title = shown()
        return title if title.startswith("streamrl prefork server") else ""

    title = wait_for(named, lambda: f"the server's command line is {shown()[:80]!r}", 60)
    assert title == f"streamrl prefork server (for pid {os.getpid()})"


def test_only_python_dash_m_commands(forks):
    with pytest.raises(ValueError, match="python -m"):
        forks.popen([sys.executable, "script.py"])


def test_call_reports_a_failure(forks):
    with pytest.raises(RuntimeError, match="_exit failed in the fork server"):
        forks.call(os._exit, 2)


def test_a_script_without_a_main_guard_is_not_run_again(tmp_path, subprocess_env):
    """multiprocessing re-imports the caller's __main__ in each child; a script calling the
    demo with no `if __name__ == "__main__"` would have run again, recursively."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\n"
        "from streamrl.local.prefork import Prefork\n"
        "print('script ran', flush=True)\n"
        "p = Prefork().popen([sys.executable, '-m', 'tests.support.prefork_child', 'exit', '5'],"
        f" {str(tmp_path / 'child.log')!r})\n"
        "print('child exit', p.wait(timeout=60), flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120,
        env=subprocess_env, cwd=ROOT,
    )  # fmt: skip
    assert done.stdout.splitlines() == ["script ran", "child exit 5"], done.stderr[-2000:]
    assert "argv=['exit', '5']" in (tmp_path / "child.log").read_text()


@pytest.mark.parametrize(
    ("argv", "demo"),
    [
        (["-m", "demo", "--json"], True),  # python -m streamrl.cli demo, while it is imported
        (["/venv/bin/streamrl", "demo"], True),
        (["streamrl", "--redis", "redis://h:1", "--run", "r", "--debug", "demo"], True),
        (["streamrl", "--run=demo", "status"], False),
        (["streamrl", "--run", "demo", "status"], False),  # a run named demo
        (["streamrl", "--run", "demo", "demo", "--json"], True),
        (["streamrl", "--run", "demo", "demo", "--help"], False),
        (["streamrl", "demo", "--help"], False),
        (["streamrl", "status", "demo"], False),
        (["streamrl"], False),
        (["-c", "demo"], False),  # python -c ...: not the command line
        (["/usr/bin/pytest", "demo"], False),
    ],
)
def test_demo_argv_tells_the_demo_from_every_other_command(argv, demo):
    assert demo_argv(argv) is demo


def test_demo_argv_knows_every_option_of_the_group_that_takes_a_value():
    """``demo_argv`` runs before click has parsed anything, so it keeps its own list of the
    group's options that take a value: the list must be the group's."""
    from streamrl.cli import main
    from streamrl.local.prefork import _VALUE_OPTIONS

    takes_value = {name for p in main.params if not getattr(p, "is_flag", False) for name in p.opts}
    assert takes_value == _VALUE_OPTIONS


_EARLY = (
    "import sys; sys.argv = {argv!r}; import streamrl.cli; "
    "from streamrl.local import prefork; forks = prefork.take_early(); "
    "print(forks is not None and forks.server_pid is not None)"
)


@pytest.mark.parametrize(
    ("argv", "env", "early"),
    [
        (["-m", "demo", "--seconds", "1"], {}, True),
        (["-m", "status"], {}, False),
        (["-m", "demo"], {"STREAMRL_PREFORK": "0"}, False),
    ],
)
def test_the_command_line_starts_the_demos_fork_server_before_its_own_imports(
    subprocess_env, argv, env, early
):
    """Importing the command line for `streamrl demo` has started the fork server (whose
    imports are the demo's start-up critical path); for any other command, or with prefork
    off, it has not."""
    out = subprocess.run(
        [sys.executable, "-c", _EARLY.format(argv=argv)],
        env={**subprocess_env, **env}, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(early)


# a fork server killed under its children (a signal to the demo's whole process group reaches
# the server, while the rollout workers sit in sessions of their own)
_SERVER_KILLED = """
import os, signal, subprocess, sys, time
from streamrl.local.prefork import Prefork
forks = Prefork()
p = forks.popen([sys.executable, "-m", "tests.support.prefork_child", "wait"], None, {}, True)
time.sleep(0.5)
os.kill(forks.server_pid, signal.SIGKILL)
time.sleep(0.5)
print("poll", p.poll(), flush=True)  # the child lives on: None, not the server's 255
try:
    p.wait(timeout=0.5)
    print("wait returned", flush=True)
except subprocess.TimeoutExpired:
    print("wait timed out", flush=True)
p.send_signal(signal.SIGTERM)  # reaches the orphan
print("code", p.wait(timeout=30), flush=True)
try:
    state = open(f"/proc/{p.pid}/stat").read().rsplit(")", 1)[1].split()[0]
except OSError:
    state = "gone"
print("alive", state not in ("gone", "Z"), flush=True)
"""


def test_a_child_outlives_its_killed_server_and_can_still_be_stopped(subprocess_env):
    """The demo stops its workers by asking `poll()` who is alive: with the server gone, each
    forked child used to read as exited (255), was never stopped, and ran on after the demo."""
    out = subprocess.run(
        [sys.executable, "-c", _SERVER_KILLED], capture_output=True, text=True,
        env=subprocess_env, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[:2] == ["poll None", "wait timed out"], out.stdout
    assert lines[2].startswith("code ") and lines[3] == "alive False", out.stdout


# a fork asked of a server that is still importing, then the server stopped (the demo
# interrupted in its first seconds): the server is gone, so the child can never run
_STOPPED_WHILE_IMPORTING = """
import os, sys, threading, time
from streamrl.local.prefork import Prefork
marker = sys.argv[1]
forks = Prefork()  # a new server: its imports take seconds
pid = forks.server_pid
def ask():
    try:
        forks.popen([sys.executable, "-m", "tests.support.prefork_child", "touch", marker])
        print("forked", flush=True)
    except Exception as e:
        print("popen:", type(e).__name__, flush=True)
asker = threading.Thread(target=ask, daemon=True)
asker.start()
time.sleep(0.3)
forks.stop()
asker.join(30)
print("asker done", not asker.is_alive(), flush=True)
print("server gone", not os.path.exists(f"/proc/{pid}"), forks.server_pid, flush=True)
print("ran", os.path.exists(marker), flush=True)
"""


def test_a_stopped_server_forks_nothing_it_was_asked_for(subprocess_env, tmp_path):
    marker = tmp_path / "ran"
    out = subprocess.run(
        [sys.executable, "-c", _STOPPED_WHILE_IMPORTING, str(marker)], capture_output=True,
        text=True, env=subprocess_env, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("popen: "), out.stdout  # the asker hears the server went
    assert lines[1:] == ["asker done True", "server gone True None", "ran False"], out.stdout
    assert not marker.exists()
