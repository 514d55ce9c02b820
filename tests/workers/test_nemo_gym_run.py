"""``nemo-gym`` with ``mode=run``: a NeMo Gym 0.7-style environment server drives each episode
(``POST /run``), its agent calling the rollout worker's policy endpoint under the episode's
capture key (tests/support/nemo_gym_server.py with ``--model-url``, in its own process). Real
rq workers, real Redis, real HTTP; the work horse SIGKILLs itself right after answering a model
turn (the episode's ``/run`` in flight), twice.

Checked on the server's own log: every sample is scored once, from the attempt it was verified
in; the killed ones were redone as the next ``episode_id.attempt``; every session the server
seeded was closed (the killed attempts' too: their agent's next model call found no open
episode); the verified session holds the trajectory's calls once each; every turn carries the
policy's token ids; failures are dead letters, never rewards."""

from __future__ import annotations

import json

import pytest

from tests.support.nemo_gym import counter_row, free_port, resources_server
from tests.support.nemo_gym_kills import run_mode_kill_run, run_mode_rows


@pytest.fixture(scope="module")
def env_server(tmp_path_factory):
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    model_url = f"http://{endpoint}"
    with resources_server(tmp_path_factory.mktemp("ng-run"), "typed", model_url) as url:
        yield url, endpoint


@pytest.mark.timeout(300)
def test_run_mode_kills_redo_the_episode_as_the_next_attempt(
    env_server, redis_url, subprocess_env, tmp_path
):
    url, endpoint = env_server
    extra = [
        counter_row("terminal", 1, [1], fault="run_terminal"),
        counter_row("flaky", 2, [3], fault="run_flaky"),
        counter_row("masked", 1, [1], fault="verify_masked"),
    ]
    rows = run_mode_rows(6, seed=3, extra=extra)
    report = run_mode_kill_run(redis_url, url, endpoint, tmp_path, subprocess_env, rows,
                               faults="after_policy_turn:2", run="ng-run")  # fmt: skip
    why = json.dumps(report)
    assert report["drained"], why
    assert report["kills"] == {"after_policy_turn": 2}, why
    # 6 good prompts and the flaky one complete; the terminal failure and the masked sample
    # are dead letters, their groups dropped: nothing is scored 0, nothing twice
    assert (report["groups_completed"], report["groups_dropped"]) == (7, 2), why
    assert report["scored"] == 14 and report["scored_0"] == 0, why
    assert report["scored_twice"] == 0, why
    kinds = report["dead_letter_kinds"]
    assert kinds == ["", "masked:judge_unavailable"], why
    terminal = [r for t, r in report["dead_letters"].items() if t.startswith("terminal")]
    assert len(terminal) == 2 and all("terminal=True" in r for r in terminal), why
    # the server's side: each verified session holds the trajectory's calls, once; every
    # session it seeded was closed, the killed attempts' too
    assert report["calls_applied_twice"] == 0 and report["sessions_not_as_recorded"] == 0, why
    assert report["sessions_leaked"] == 0, why
    assert report["sessions_closed"] == report["sessions_seeded"], why
    # 14 scored + 2 masked verified once each; the killed attempts never reached /verify
    assert report["sessions_verified"] == 16, why
    # the episodes in flight at a kill were redone as their next attempts: their dead
    # attempts' sessions were seeded, never verified, and closed
    assert sum(n for a, n in report["verified_attempts"].items() if a != "0") >= 2, why
    assert report["sessions_seeded"] >= report["sessions_verified"] + 2, why
    assert report["samples_without_tokens"] == 0, why
