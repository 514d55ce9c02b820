"""`procs.lower_priority`: every thread of a running process gets the nice value, and what it
starts afterwards inherits it (the demo's workers fork their work horses after it is set);
`procs.at_nice`: a command born at a nice value;
`procs.role_of`: which of the demo's processes one is, by its title."""

from __future__ import annotations

import os
import subprocess
import sys

import psutil
import pytest

from streamrl.local.procs import at_nice, lower_priority, role_of, stop_all

# a child with a second thread already running, which then, told to on stdin, forks a
# grandchild and prints the grandchild's nice value
_CHILD = """
import os, sys, threading, time
threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
print("ready", flush=True)
sys.stdin.readline()
pid = os.fork()
if pid == 0:
    print(os.getpriority(os.PRIO_PROCESS, 0), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values")
def test_every_thread_and_later_children_get_the_lower_priority():
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        threads = [t.id for t in psutil.Process(proc.pid).threads()]
        assert len(threads) == 2
        assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in threads} == {0}
        lower_priority(proc.pid, 7)
        assert {os.getpriority(os.PRIO_PROCESS, tid) for tid in threads} == {7}
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # this process is left as it was
        proc.stdin.write("fork\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "7"  # the grandchild, forked afterwards
        proc.wait(timeout=10)
    finally:
        stop_all([proc])


def test_a_process_that_is_gone_is_no_error():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    lower_priority(proc.pid, 5)  # reaped: nothing to do, nothing raised


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values")
def test_a_command_at_nice_is_started_at_that_value():
    """The value is the program's from its first instruction (`nice -n`), not set after it has
    started threads; asking for this process's own value or None changes nothing."""
    cmd = [sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"]
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    assert at_nice(cmd, None) == cmd and at_nice(cmd, ours) == cmd
    out = subprocess.run(at_nice(cmd, ours + 6), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(ours + 6)


def test_roles_from_process_titles():
    assert role_of("/venv/bin/python -m streamrl.cli learn --config x.toml") == "learner"
    assert role_of("rq:worker:srl-rollout-1-99-abc: Processing streamrl...") == "worker"
    assert role_of("/venv/bin/python -m rq.cli worker -u redis://x srl-verify") == "worker"
    assert role_of("/usr/bin/redis-server 127.0.0.1:6400") == "redis"
    assert role_of("streamrl prefork server (for pid 123)") == "prefork"
    assert role_of("/venv/bin/python -m streamrl.cli demo --json") == "other"
