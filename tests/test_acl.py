"""Least-privilege Redis users (``streamrl acl --apply``) on a redis-server of the test's own:
the pipeline runs with each role on its own user (producer, real rq rollout and verify
workers, a learner training the tiny model) and every prompt is scored into one group and
taken by the learner once, with no command of the pipeline refused on its own run; then the
rollout user cannot write ``scored``/``groups``/``policy``, run the learner's or producer's
scripts on their keys, or read another run, and the observer cannot write but
``streamrl status`` works with it."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter

import pytest
import redis
import torch
from redis.exceptions import NoPermissionError

from streamrl import schema
from streamrl.bus.acl import ROLES
from streamrl.bus.keys import Keys
from streamrl.bus.streams import Entry, Scripts, deadletter_call, ensure_groups, xrange_all
from streamrl.bus.values import id_order
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.connection import connect
from streamrl.defaults import ROLLOUT_GROUP, ROLLOUT_QUEUE, VERIFY_QUEUE
from streamrl.envs import make_env
from streamrl.learner.config import LearnerConfig
from streamrl.learner.loop import run_learner
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.local.procs import WorkerProcs
from streamrl.models.tiny import save_tiny
from streamrl.workers import leases
from streamrl.workers.context import write_config
from streamrl.workers.lease_worker import ensure_leases
from tests.support.waiting import wait_for

RUN, OTHER = "acl", "other"
PROMPTS, GROUP = 12, 4
NEVER_STALE = 10**6


def _cli(url: str, *args: str, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "streamrl.cli", "--redis", url, "--run", RUN, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)


def _scrape_and_watch(url: str, env: dict) -> tuple[str, str, list[str]]:
    """One scrape of ``streamrl metrics``, two seconds of ``streamrl watch`` and the live
    page and trajectory list of ``streamrl view``, all on ``url``'s user: what the exporter
    served, what the live view drew, and the web pages."""
    base = [sys.executable, "-m", "streamrl.cli", "--redis", url, "--run", RUN]
    metrics = subprocess.Popen([*base, "metrics", "--port", "0", "--addr", "127.0.0.1"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env)  # fmt: skip
    watch = subprocess.Popen([*base, "watch", "--interval", "0.2"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env={**env, "COLUMNS": "200", "TERM": "dumb"})  # fmt: skip
    view = subprocess.Popen([*base, "view", "--port", "0"], stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    try:
        served = ""
        for line in metrics.stdout:  # type: ignore[union-attr]
            found = re.search(r"http://[0-9.]+:[0-9]+/metrics", line)
            if found:
                served = urllib.request.urlopen(found.group(0), timeout=30).read().decode()
                break
        pages = []
        for line in view.stderr:  # type: ignore[union-attr]
            found = re.search(r"http://[0-9.]+:[0-9]+/", line)
            if found:
                for path in ("api/live", "samples"):
                    with urllib.request.urlopen(found.group(0) + path, timeout=30) as res:
                        pages.append(res.read().decode())
                break
        time.sleep(2.0)
    finally:
        metrics.terminate()
        view.terminate()
        watch.send_signal(signal.SIGINT)
        watched = watch.communicate(timeout=30)[0]
        metrics.communicate(timeout=30)
        view.communicate(timeout=30)
    return served, watched, pages


def test_every_role_on_its_own_acl_user(tmp_path, subprocess_env):
    cfg = RunConfig(
        run=RUN,
        env="counter",
        group_size=GROUP,
        policy=PolicyConfig(latency_s=0.0, wrong_rate=0.25, options={"token_vocab": 24}),
        rollout=RolloutConfig(lease_seconds=4, max_concurrent=8, read_batch=8, max_policy_lag_s=0),
        learner={"max_staleness": NEVER_STALE},  # the scripted policy stays at version 0
        verify=VerifyConfig(lease_seconds=4),
        streams=StreamConfig(heartbeat_s=0.5),
    )
    # a Redis of its own (LocalPipeline starts one): the users must not reach other tests.
    # The admin (default user) opens both runs: config, streams, groups, ``srl:runs``.
    with LocalPipeline(cfg, directory=tmp_path, worker_env=subprocess_env) as p:
        admin, port = p.r, p.server.port  # type: ignore[union-attr]
        other = Keys(OTHER)
        write_config(admin, RunConfig(run=OTHER, env="counter", group_size=GROUP))
        ensure_groups(admin, other)
        admin.set(other.key("secret"), "x")

        pw = {role: f"pw-{role}-0123456789" for role in ROLES}
        out = _cli(
            p.url, "acl", "--apply", *(f"--password={r}={w}" for r, w in pw.items()),
            env=subprocess_env,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        lines = out.stdout.strip().splitlines()
        assert [ln.split()[2] for ln in lines] == [f"srl-{RUN}-{role}" for role in ROLES]
        url = {r: f"redis://srl-{RUN}-{r}:{w}@127.0.0.1:{port}/0" for r, w in pw.items()}
        admin.acl_log_reset()

        procs = [
            WorkerProcs(url["rollout"], log_dir=tmp_path / "logs", env=subprocess_env),
            WorkerProcs(url["verify"], log_dir=tmp_path / "logs", env=subprocess_env),
        ]
        learner_cfg = LearnerConfig(
            model=str(save_tiny(tmp_path / "tiny")), output_dir=str(tmp_path / "learner"),
            device="cpu", torch_threads=1, batch_groups=4, checkpoint_every=2, block_ms=100,
            max_staleness=NEVER_STALE,
        )  # fmt: skip
        stop, box, threads = threading.Event(), {}, torch.get_num_threads()
        learner = threading.Thread(
            target=lambda: box.update(
                state=run_learner(url["learner"], RUN, learner_cfg, stop=stop)
            )
        )
        try:
            procs[0].start(ROLLOUT_QUEUE, 1)
            procs[1].start(VERIFY_QUEUE, 1)
            leases.top_up_shards(admin, ROLLOUT_QUEUE, RUN, waiting=1)
            leases.top_up_shards(admin, VERIFY_QUEUE, RUN, waiting=1)
            learner.start()
            producer = connect(url["producer"], resilient=True)
            from streamrl.producer.produce import Producer

            Producer(producer, RUN).from_env(make_env("counter"), PROMPTS, GROUP, seed=0)
            p.wait_groups(PROMPTS, timeout=120)
            wait_for(
                lambda: int(admin.hget(p.keys.learner, "groups_consumed") or 0) >= PROMPTS,
                "the learner to take every group", 120,
            )  # fmt: skip
        finally:
            stop.set()
            learner.join(60)
            torch.set_num_threads(threads)  # run_learner set this process's torch_threads
            admin.set(p.keys.halt, 1)
            for wp in procs:
                wp.stop(timeout=15)
        # what the pipeline's users were refused: only the other run's keys (a rollout or
        # verify worker's idle check reads every listed run and skips those it may not read)
        refused = admin.acl_log(count=1000)
        acc = p.account(task_ids("counter", 0, PROMPTS, GROUP))
        pending = [  # groups read into a batch still filling when the learner was stopped
            e["message_id"].decode()
            for e in admin.xpending_range(p.keys.groups, "learner", "-", "+", PROMPTS + 1)
        ]
        per_prompt = Counter(
            schema.GROUP.decode(f[b"p"]).prompt_id for _, f in xrange_all(admin, p.keys.groups)
        )

        # the rollout user: no writes to the learner's inputs or outputs, no other run
        ro = redis.Redis.from_url(url["rollout"])
        denied = {}
        for name in ("scored", "groups", "policy"):
            with pytest.raises(NoPermissionError) as e:
                ro.xadd(getattr(p.keys, name), {"p": b"forged"})
            denied[name] = str(e.value)
        with pytest.raises(NoPermissionError):  # the learner's trim, on groups
            Scripts(ro).trim(keys=[p.keys.groups], args=[0, 2**62])
        with pytest.raises(NoPermissionError):  # the producer's script, on its positions
            Scripts(ro).produce(keys=[p.keys.tasks, p.keys.producer("x")], args=[0, 1])
        with pytest.raises(NoPermissionError):
            ro.get(other.key("secret"))
        with pytest.raises(NoPermissionError):
            ro.xrange(other.tasks)
        with pytest.raises(NoPermissionError):
            ro.config_get("maxmemory-policy")
        assert ensure_leases(ro, [ROLLOUT_QUEUE]) == 0  # skips the run it may not read
        # a rollout worker's dead-letter call runs on its user (it declares no ``scored``)
        unowned = Entry("0-1", "counter:0:0:0", b"", 1)
        dl_keys, dl_args = deadletter_call(
            p.keys, p.keys.tasks, ROLLOUT_GROUP, "nobody", [(unowned, b"dl", b"")], True
        )
        assert Scripts(ro).deadletter(keys=dl_keys, args=dl_args) == [0]
        # the observer: reads, never writes
        obs = redis.Redis.from_url(url["observer"])
        for write in (
            lambda: obs.xadd(p.keys.tasks, {"p": b"x"}),
            lambda: obs.set(p.keys.config, "x"),
            lambda: obs.delete(p.keys.stats),
            lambda: obs.hset(p.keys.learner, "step", 0),
        ):
            with pytest.raises(NoPermissionError):
                write()
        with pytest.raises(NoPermissionError):
            obs.get(other.key("secret"))
        status = _cli(url["observer"], "status", "--json", env=subprocess_env)
        export = _cli(url["observer"], "export", "--format", "nemo-gym", env=subprocess_env)
        scrape, watched, pages = _scrape_and_watch(url["observer"], subprocess_env)
        p.procs = None  # the workers are stopped above

    own_run = [e for e in refused if f"{{{OTHER}}}" not in e["object"]]
    assert own_run == [], own_run
    assert (acc.lost, acc.duplicated, acc.failures, acc.malformed_groups) == (0, 0, 0, 0)
    assert acc.scored == PROMPTS * GROUP
    assert len(per_prompt) == PROMPTS and set(per_prompt.values()) == {1}
    state = box["state"]
    # each group once: stepped on and acked, or unacked after the checkpoint (a restart redoes it)
    assert state.counters.groups_consumed + len(pending) == PROMPTS and state.step > 0
    assert all(id_order(i) > id_order(state.last_id) for i in pending)
    assert all("permission" in v for v in denied.values()), denied
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["groups_completed"] == PROMPTS
    # the observer's other reads: export, the Prometheus exporter, the live view, the web view
    assert export.returncode == 0, export.stderr
    assert len(export.stdout.splitlines()) == PROMPTS * GROUP
    assert "streamrl_redis_up 1.0" in scrape, scrape[:2000]
    assert f'streamrl_groups_completed_total{{run="{RUN}"}} {float(PROMPTS)}' in scrape
    assert "permission" not in watched.lower() and "Traceback" not in watched, watched[-2000:]
    assert str(PROMPTS) in watched, watched[-2000:]
    live, samples = pages  # streamrl view: every sample on the chart, the newest in the list
    assert sum(json.loads(live)["chart"]["samples"]) == PROMPTS * GROUP
    assert samples.count('class="sample-link"') == min(50, PROMPTS * GROUP)


def test_acl_prints_rules_and_refuses_a_bad_password_option(subprocess_env):
    base = [sys.executable, "-m", "streamrl.cli", "--run", "r[1]", "acl"]
    ok = subprocess.run([*base, "--password", "observer=pw-o"], capture_output=True, text=True,
                        env=subprocess_env, timeout=60)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    observer = ok.stdout.splitlines()[-1].split()
    assert observer[:6] == ["ACL", "SETUSER", "srl-r[1]-observer", "reset", "on", ">pw-o"]
    assert r"%R~srl:{r\[1\]}:*" in observer  # the run's name is a literal in the pattern
    assert not [w for w in observer if w.startswith("~")]  # the observer writes nothing
    bad = subprocess.run([*base, "--password", "janitor=x"], capture_output=True, text=True,
                         env=subprocess_env, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "expected ROLE=PASSWORD" in bad.stderr
    assert "Traceback" not in bad.stderr
