"""A real OpenEnv server (the echo environment ``openenv init`` writes from openenv-core's own
template, unchanged: one session at a time; served by the package in a process of its own,
the ``openenv_server`` fixture) through real rq workers.

Rollout work horses SIGKILL themselves inside the windows that matter (a session's reset
answered and not yet checkpointed; a step applied and answered and not yet checkpointed: the
fault points of ``streamrl.envs._failpoints``), the first hits, then at random from a printed
seed: the episodes go on in fresh sessions with the confirmed steps replayed, and the server's
own count of the steps it applied in the session that finished each episode equals the
episode's steps (tests/support/openenv_kills.py): none applied twice, none scored from a
repeat, every reward right. A server that is down dead-letters its samples: never a 0."""

from __future__ import annotations

import json
import os
import random

import pytest

from streamrl import schema
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.producer.produce import Producer
from tests.support.openenv_kills import config, kill_run, write_rows
from tests.support.openenv_server import free_port
from tests.support.waiting import wait_for


def _check(f: dict, why: str) -> None:
    assert f["drained"], why
    assert f["scored"] == f["samples"] and f["scored_twice"] == f["lost"] == 0, why
    assert f["failures"] == f["dead_letters"] == 0, why
    assert f["steps_applied_twice"] == f["steps_not_applied"] == 0, why
    assert f["rewards_wrong"] == 0, why


@pytest.mark.timeout(400)
def test_kills_after_a_reset_and_after_steps_apply_each_step_once(
    openenv_server, redis_url, subprocess_env, tmp_path
):
    f = kill_run(openenv_server.url, redis_url, subprocess_env, tmp_path, run="openenv-kills",
                 faults="after_open:1,after_tool_send:3")  # fmt: skip
    why = json.dumps(f)
    points = [site.split()[0] for site in f["kills"]]
    assert points.count("after_open") == 1 and points.count("after_tool_send") == 3, why
    _check(f, why)
    assert f["samples_finished_in_a_fresh_session"] >= 3, why  # the killed episodes went on


@pytest.mark.timeout(400)
def test_seeded_random_kills_replay_confirmed_steps_once(
    openenv_server, redis_url, subprocess_env, tmp_path
):
    seed = int(os.environ.get("STREAMRL_KILL_SEED") or random.randrange(1 << 30))
    f = kill_run(openenv_server.url, redis_url, subprocess_env, tmp_path, run="openenv-random",
                 faults="*:4", p=0.12, seed=seed)  # fmt: skip
    why = f"seed {seed} (rerun with STREAMRL_KILL_SEED={seed}): {json.dumps(f)}"
    assert f["kills"], why
    _check(f, why)


@pytest.mark.timeout(300)
def test_a_server_that_is_down_dead_letters_and_never_scores(redis_url, subprocess_env, tmp_path):
    prompts = 8
    write_rows(tmp_path / "rows.jsonl", prompts)
    cfg = config("openenv-down", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    cfg.group_size = 2
    with LocalPipeline(
        cfg, url=redis_url, directory=tmp_path / "run", worker_env=subprocess_env
    ) as p:
        Producer(p.r, cfg.run).from_jsonl(tmp_path / "rows.jsonl", "openenv", 2)
        p.start_workers(rollout=1, verify=1)
        p.wait_groups(prompts, timeout=180)
        # a group is dropped at its first dead sample; its other sample's letter may follow
        wait_for(
            lambda: p.r.xlen(p.keys.dead) >= prompts * 2,
            lambda: f"{p.r.xlen(p.keys.dead)} of {prompts * 2} samples dead-lettered",
            timeout=60,
        )
        scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]
        dead = [schema.DEAD_LETTER.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.dead)]
        completed, dropped = p.stat("groups_completed"), p.stat("groups_dropped")
    assert completed == 0 and dropped == prompts
    assert all(s.reward is None for s in scores) and len(dead) == prompts * 2
    assert all("openenv" in d.reason for d in dead), dead[0].reason
