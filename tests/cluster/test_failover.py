"""A Redis Cluster master SIGKILLed under a whole training run. Three masters with a replica
each; rq on a plain Redis beside them; every role a real process started through the CLI:
rq rollout and verify workers, ``streamrl produce`` (held by admission control all run, so it
is mid-run when the master dies), ``streamrl learn`` and the ``streamrl metrics`` exporter.
The master that serves the run's keys (all of them: the run is unsharded) is killed once the
learner has taken ``KILL_AT`` groups; while its replica takes over, ``streamrl status`` and
another ``streamrl worker`` are started. Every role must ride the failover out, and the run
must end with every prompt pushed once, scored into exactly one group and consumed by the
learner exactly once, the learner training on past the failover."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter

import redis

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups, xrange_all
from streamrl.bus.values import id_order
from streamrl.connection import connect
from streamrl.defaults import LEARNER_GROUP, ROLLOUT_QUEUE, VERIFY_QUEUE
from streamrl.local.embedded import free_port
from streamrl.local.procs import WorkerProcs, stop_all
from streamrl.models.tiny import save_tiny
from streamrl.workers import leases
from tests.support.cli import ROOT
from tests.support.cluster import LocalCluster
from tests.support.waiting import wait_for

RUN = "failover"
PROMPTS, GROUP = 96, 4
KILL_AT = 8  # groups the learner has taken when the master is killed
NODE_TIMEOUT_MS = 3000
RECOVERED = "Redis Cluster answers again"
_OUTAGE = re.compile(r'outage_s"?[=:] ?([0-9.]+)')

CONFIG = """\
run = "{run}"
env = "copy"
group_size = {group}

[policy]
backend = "hf"
model = "{model}"
max_new_tokens = 4
options = {{ reload_check_s = 0.1 }}

[streams]
claim_idle_ms = 1500
heartbeat_s = 0.3

[learner]
model = "{model}"
output_dir = "{out}"
device = "cpu"
torch_threads = 1
batch_groups = 4
max_staleness = 1             # a window of 2 batches: the producer waits on it all run
lr = 5e-4
checkpoint_every = 2
sync_every = 1
block_ms = 200
"""


def _outages(text: str) -> list[float]:
    """``outage_s`` of every "answers again" line of a role's log (JSON or key=value)."""
    lines = [line for line in text.splitlines() if RECOVERED in line]
    return [float(m.group(1)) for m in map(_OUTAGE.search, lines) if m]


def _redis_up(port: int) -> float | None:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    for line in body.splitlines():
        if line.startswith("streamrl_redis_up "):
            return float(line.split()[1])
    return None


def test_every_role_rides_out_a_master_failover(redis_url, subprocess_env, tmp_path):
    env = {**subprocess_env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    model = save_tiny(tmp_path / "model")
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(CONFIG.format(run=RUN, group=GROUP, model=model, out=tmp_path / "learner"))
    logs = tmp_path / "logs"
    logs.mkdir()
    cluster = LocalCluster(
        tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS
    ).start()
    data, control = cluster.url, redis_url
    cli = [sys.executable, "-m", "streamrl.cli", "--redis", data, "--control-redis", control,
           "--run", RUN]  # fmt: skip

    def start(name: str, *argv: str) -> subprocess.Popen:
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        return subprocess.Popen(
            [*cli, *argv], stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip

    def log_of(name: str) -> str:
        return (logs / f"{name}.log").read_text(errors="replace")

    procs = WorkerProcs(data, log_dir=logs, env=env, control_url=control)
    others: list[subprocess.Popen] = []
    try:
        keys = Keys(RUN)
        r = connect(data, resilient=True)  # the test's own reads ride the failover too
        rq = redis.Redis.from_url(control)
        procs.start(ROLLOUT_QUEUE, 1)
        procs.start(VERIFY_QUEUE, 1)
        metrics_port = free_port()
        metrics = start("metrics", "metrics", "--port", str(metrics_port), "--addr", "127.0.0.1")
        producer = start("produce", "produce", "--config", str(cfg_path), "--count", str(PROMPTS))
        learner = start("learn", "learn", "--config", str(cfg_path))
        others = [metrics, producer, learner]

        def learner_field(name: str) -> int:
            return int(float(r.hget(keys.learner, name) or 0))

        wait_for(lambda: learner_field("groups_consumed") >= KILL_AT, lambda: log_of("learn"), 300)
        assert _redis_up(metrics_port) == 1
        step_at_kill = learner_field("step")
        assert producer.poll() is None, log_of("produce")  # still held by admission control
        master = cluster.node_of(keys.config)
        replica = cluster.replica_of(master)
        assert cluster.node_of(keys.tasks) == cluster.node_of(keys.groups) == master
        cluster.kill(master)  # SIGKILL: no goodbye to the cluster
        killed_at = time.monotonic()
        # started while the master is down: a one-shot reader and one more rollout worker
        status = start("status", "status", "--json")
        late = start("late-worker", "worker", "rollout")
        others += [status, late]
        cluster.wait_promoted(replica, master)
        promotion_s = time.monotonic() - killed_at

        assert status.wait(timeout=120) == 0, log_of("status")[-3000:]
        shown = json.loads(log_of("status").strip().splitlines()[-1])
        assert shown["run"] == RUN and shown["redis"]["node"] == f"127.0.0.1:{replica}"
        assert producer.wait(timeout=600) == 0, log_of("produce")[-3000:]
        # the learner is stopped once it has every group, not after an idle spell: on a loaded
        # machine the pipeline went 20 s without a group after the failover (it once exited
        # at 95 of 96 groups, the producer at 27 of 96 and then held by admission for good)
        wait_for(lambda: learner_field("groups_consumed") >= PROMPTS,
                 lambda: log_of("learn")[-3000:], 600)  # fmt: skip
        learner.send_signal(signal.SIGTERM)
        assert learner.wait(timeout=120) == 0, log_of("learn")[-3000:]
        wait_for(lambda: _redis_up(metrics_port) == 1, lambda: log_of("metrics"), 60)
        assert metrics.poll() is None, log_of("metrics")[-3000:]
        assert late.poll() is None, log_of("late-worker")[-3000:]  # it waited, then served
        assert leases.queue_health(rq, ROLLOUT_QUEUE)["workers"] == 2
        for name, p in procs.procs:
            assert p.poll() is None, log_of(name)[-3000:]

        # every prompt pushed once
        task_ids = [schema.TASK.decode(f[b"p"]).task_id for _, f in xrange_all(r, keys.tasks)]
        assert len(task_ids) == PROMPTS * GROUP and len(set(task_ids)) == len(task_ids)
        # every prompt scored into exactly one complete group
        groups = [schema.GROUP.decode(f[b"p"]) for _, f in xrange_all(r, keys.groups)]
        per_prompt = Counter(g.prompt_id for g in groups)
        assert len(per_prompt) == PROMPTS and set(per_prompt.values()) == {1}
        assert all(len(g.samples) == GROUP for g in groups)
        assert r.xlen(keys.dead) == 0
        # the learner took each group exactly once: what its last checkpoint covers is acked,
        # the open window (taken after its last step) stays pending for the next learner
        final = json.loads(log_of("learn").strip().splitlines()[-1])
        assert learner_field("groups_consumed") == PROMPTS  # committed + open window
        pending = r.xpending_range(keys.groups, LEARNER_GROUP, "-", "+", PROMPTS)
        assert final["counters"]["groups_consumed"] + len(pending) == PROMPTS, final
        assert all(id_order(p["message_id"].decode()) > id_order(final["last_id"]) for p in pending)
        assert final["step"] > step_at_kill, (final, step_at_kill)  # trained on past the kill
        # each role that lost the master says when it had it back (its outage, for the record)
        ridden = {name: _outages(log_of(name)) for name in ("learn", "produce", "late-worker")}
        ridden["workers"] = [x for name, _ in procs.procs for x in _outages(log_of(name))]
        assert ridden["learn"] and ridden["produce"] and ridden["workers"], ridden
        figures = {"promotion_s": round(promotion_s, 2), "outage_s": ridden}
        figures |= {"prompts": PROMPTS, "groups": len(groups), "step_at_kill": step_at_kill}
        figures |= {"final_step": final["step"]}
        print("failover figures:", json.dumps(figures))
    finally:
        stop_all([p for p in others if p.poll() is None])
        procs.stop(timeout=10)
        cluster.stop()


DP_CONFIG = """\
[learner]
model = "{model}"
output_dir = "{out}"
torch_threads = 1
batch_groups = 2
max_staleness = 100
lr = 1e-3
checkpoint_every = 2
sync_every = 2
block_ms = 100
dist_timeout_s = 120
"""
DP_GROUPS = 24


def test_a_data_parallel_learner_rides_out_a_master_failover(subprocess_env, tmp_path):
    """Two ranks under torchrun (`streamrl learn --nproc 2`): rank 0 reads Redis and rides
    the failover out while rank 1 waits for it in the next collective; the job goes on and
    takes every group exactly once."""
    from tests.learner.groupdata import feed, make_groups

    env = {**subprocess_env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    model = save_tiny(tmp_path / "model")
    groups = make_groups(model, DP_GROUPS, seed=21)
    cfg_path = tmp_path / "learn.toml"
    cfg_path.write_text(DP_CONFIG.format(model=model, out=tmp_path / "out"))
    log_path = tmp_path / "learn.log"
    with LocalCluster(
        tmp_path / "cluster", masters=3, replicas=1, node_timeout_ms=NODE_TIMEOUT_MS
    ) as cluster, open(log_path, "wb") as log:  # fmt: skip
        run, keys = "dp-failover", Keys("dp-failover")
        r = connect(cluster.url, resilient=True)
        ensure_groups(r, keys)
        feed(r, keys, groups[: DP_GROUPS // 2])
        proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl.cli", "--redis", cluster.url, "--run", run,
             "learn", "--config", str(cfg_path), "--nproc", "2", "--exit-when-idle", "10"],
            env={**env, "STREAMRL_RUN": run}, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
        said = lambda: log_path.read_text(errors="replace")[-3000:]  # noqa: E731
        try:
            wait_for(lambda: int(r.hget(keys.learner, "step") or 0) >= 2, said, 300)
            assert r.hget(keys.learner, "ranks") == b"2"
            step_at_kill = int(r.hget(keys.learner, "step"))
            cluster.kill_master_of(keys.groups)
            feed(r, keys, groups[DP_GROUPS // 2 :])  # the second half, after the failover
            assert proc.wait(timeout=300) == 0, said()
        finally:
            stop_all([proc])
        text = log_path.read_text(errors="replace")
        assert RECOVERED in text, text[-3000:]  # rank 0 lost the master and had it back
        consumed = int(r.hget(keys.learner, "groups_consumed"))
        last_id = r.hget(keys.learner, "last_id").decode()
        pending = r.xpending_range(keys.groups, LEARNER_GROUP, "-", "+", DP_GROUPS)
        assert consumed == DP_GROUPS  # committed + open window, each group once
        assert all(id_order(p["message_id"].decode()) > id_order(last_id) for p in pending)
        assert int(r.hget(keys.learner, "step")) > step_at_kill  # trained on past the kill
        print("data-parallel failover outage_s:", _outages(text))
