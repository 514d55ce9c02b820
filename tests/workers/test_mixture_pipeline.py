"""A mixture through real rq workers, changed mid-run with the real `streamrl mix` command: an
environment the workers never heard of is built on its first task, a removed one's queued
tasks drain, and the restate tripwire pauses a deliberately hackable environment, with its
reason in `streamrl status`."""

from __future__ import annotations

import re

import pytest

from streamrl import schema
from streamrl.config import EnvEntry, PolicyConfig, RunConfig, TripwireConfig
from streamrl.local.pipeline import LocalPipeline, xrange_all
from streamrl.ops.drift import drift_report
from streamrl.ops.status import collect
from streamrl.producer import mixture
from streamrl.producer.mixture import MixedProducer
from streamrl.producer.produce import Producer
from streamrl.producer.tripwires import Tripwires
from tests.support.cli import run_cli
from tests.support.waiting import wait_for

ECHO = "tests.support.envs:EchoEnv"


def test_mix_changes_mid_run_and_a_tripwire_pauses_the_hackable_env(
    redis_url, subprocess_env, run_name, tmp_path
):
    cfg = RunConfig(
        run=run_name,
        group_size=2,
        policy=PolicyConfig(wrong_rate=0.0),
        envs=[
            EnvEntry(env="counter", weight=1),
            EnvEntry(
                name="echo", env=ECHO, weight=1, tripwires=TripwireConfig(window=6, pause=True)
            ),
        ],
    )
    env = {**subprocess_env, "COLUMNS": "250"}
    base = ["--redis", redis_url, "--run", run_name]
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=env) as p:
        mixture.ensure(p.r, run_name, cfg.mixture())
        producer = MixedProducer(Producer(p.r, run_name, batch_samples=8), run_name, 2, seed=3)
        producer.run_until(16)  # queued before any worker runs
        first = dict(producer.drawn)
        p.start_workers(rollout=1, verify=1)
        # another process adds `copy` (in no worker's config) and removes `counter`, whose
        # queued tasks must still be played
        out = run_cli([*base, "mix", "--env", "copy", "--weight", "1", "--remove", "counter"], env)
        assert out.returncode == 0, out.stderr
        wires = Tripwires(p.r, run_name)
        fired: dict[str, str] = {}

        def before_batch() -> None:  # as admission control would: the groups come back first
            if not fired:
                wait_for(lambda: p.stat("groups_completed") >= 16, "the first 16 groups", 120)
                fired.update(wires.check())

        producer.on_batch = before_batch
        producer.drawn = {}
        producer.run_until(40)
        p.wait_groups(40, timeout=120)
        status = collect(p.r, run_name)
        shown = run_cli([*base, "status"], env)
        drift = drift_report(p.r, run_name)  # re-verified through the mixture's names
        trajs = p.trajectories()
        scores = [schema.SCORE.decode(f[b"p"]) for _, f in xrange_all(p.r, p.keys.scored)]
    assert first.get("counter") and first.get("echo")
    assert producer.drawn == {"copy": 24}  # counter removed, echo paused: only copy after
    assert set(fired) == {"echo"} and fired["echo"].startswith("tripwire restate: ")
    rewards = {}
    for t in trajs:
        rewards.setdefault(t.env, []).append(t)
    assert {name: len(ts) for name, ts in rewards.items()} == {
        "counter": 2 * first["counter"],
        "echo": 2 * first["echo"],
        "copy": 48,
    }
    # `copy`, built by workers whose config never named it, scored by its own verifier
    assert sorted({s.reward for s in scores if s.env == "copy"}) == [1.0]
    assert drift["samples"] == 80 and all(
        (row["failed"], row["changed"]) == (0, 0) for row in drift["drift"]
    ), drift
    rows = {row["name"]: row for row in status["mixture"]["envs"]}
    assert rows["echo"]["paused"] == fired["echo"] and rows["counter"]["removed"]
    assert rows["copy"]["share"] == 1.0 and rows["copy"]["dead_letters"] == 0
    text = re.sub(r"\s+", " ", shown.stdout)
    assert shown.returncode == 0 and "PAUSED echo: tripwire restate:" in text, shown.stdout
    print("tripwire:", fired["echo"])
    # the web view's live panel shows the same per-environment table (the view extra)
    pytest.importorskip("jinja2", reason="the web view needs the view extra")
    from markupsafe import escape

    from streamrl.ops.web.app import _environment

    panel = _environment().get_template("_panel.html").render(info=status, chart={}, dead=[])
    assert 'id="mixture"' in panel and f"paused: {escape(fired['echo'])}" in panel, panel
    assert ">removed<" in panel  # counter
