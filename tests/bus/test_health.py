"""The staleness guard's rules, and what status and the learner's entry point make of them."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner
from rich.console import Console

from streamrl.bus import health
from streamrl.bus.keys import Keys
from streamrl.cli import Group
from streamrl.config import RunConfig
from streamrl.ops.views import status_table
from streamrl.schema import WorkerPolicy, encode


def observe(previous, version, newest, now, error=None, max_staleness=2) -> WorkerPolicy:
    return health.observe(
        previous,
        worker="w1",
        backend="hf",
        version=version,
        newest=newest,
        error=error,
        max_staleness=max_staleness,
        heartbeat_s=5.0,
        now=now,
    )


def test_behind_since_holds_while_too_far_behind_and_resets_once_caught_up():
    rec = observe(None, version=0, newest=2, now=100.0)  # 2 behind: allowed
    assert rec.behind_since is None
    rec = observe(rec, version=0, newest=3, now=110.0)
    assert rec.behind_since == 110.0
    rec = observe(rec, version=0, newest=5, now=150.0)
    assert rec.behind_since == 110.0  # still the first moment it fell behind
    rec = observe(rec, version=4, newest=5, now=160.0)
    assert rec.behind_since is None
    assert observe(None, version=0, newest=None, now=1.0).behind_since is None  # none announced


def test_the_guard_trips_after_max_lag_with_a_one_line_reason():
    rec = observe(None, version=0, newest=5, now=100.0, error="Error: no\n  module 'peft'")
    assert health.stale_reason(rec, 60.0, now=160.0) is None
    assert health.stale_reason(rec, 0.0, now=10_000.0) is None  # 0: guard off
    assert health.stale_reason(rec, 60.0, now=161.0) == (
        "worker w1 serves policy version 0, 5 behind newest 5 (max_staleness 2) for 61 s; "
        "last reload error: Error: no module 'peft'"
    )


def test_max_staleness_comes_from_the_learner_table():
    assert health.max_staleness(RunConfig()) == 4
    assert health.max_staleness(RunConfig(learner={"max_staleness": 1})) == 1


def test_status_shows_live_workers_and_the_fault(r):
    keys = Keys("h")
    now = 1000.0
    live = observe(None, version=1, newest=9, now=now - 4.0, error="OSError: gone")
    live.behind_since = now - 30.0
    live.server, live.in_flight, live.waiting = "http://v1:8000", 3, 2
    quiet = WorkerPolicy(worker="w2", version=9, newest=9, heartbeat_s=5.0, updated_at=now - 26)
    r.hset(keys.policy_health, mapping={"w1": encode(live), "w2": encode(quiet), "w3": b"\xc1"})
    r.set(keys.fault, "PolicyStale: worker w1 serves policy version 1")
    shown = health.policy_health(r, keys, now=now)
    assert shown == {
        "fault": "PolicyStale: worker w1 serves policy version 1",
        "workers": {
            "w1": {
                "backend": "hf",
                "version": 1,
                "newest": 9,
                "lag": 8,
                "behind_s": 30.0,
                "error": "OSError: gone",
                "server": "http://v1:8000",
                "in_flight": 3,
                "waiting": 2,
                "updated_s_ago": 4.0,
            }
        },
        "ignored": 2,  # w2: older than 3 heartbeats + 10 s; w3: undecodable
    }
    info = {
        "run": "h",
        "stages": {},
        "trajectories": 0,
        "scored": 0,
        "groups_completed": 0,
        "groups_dropped": 0,
        "dead_letters": 0,
        "policy_version": 9,
        "rq": {},
        "policy_health": shown,
    }
    console = Console(record=True, width=200)
    console.print(status_table(info))
    text = console.export_text()
    assert "FAULT: PolicyStale: worker w1 serves policy version 1" in text
    assert "OSError: gone" in text and "30 s" in text
    assert "http://v1:8000" in text and "in flight" in text and "waiting" in text


def test_a_faulted_run_stops_a_command_with_one_line(r):
    keys = Keys("f")
    health.check_fault(r, keys)  # no fault: nothing happens
    r.set(keys.fault, "PolicyStale: worker w serves policy version 0\n(details)")

    @click.group(cls=Group)  # the streamrl command's group: errors become one line
    def cli() -> None:
        pass

    @cli.command()
    def cmd() -> None:
        health.check_fault(r, keys)

    res = CliRunner().invoke(cli, ["cmd"])
    assert res.exit_code == 1
    assert res.output == "Error: PolicyStale: worker w serves policy version 0 (details)\n"
    with pytest.raises(health.RunFaulted):
        health.check_fault(r, keys)
