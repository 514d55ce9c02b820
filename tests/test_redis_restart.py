"""Redis killed and restarted under a whole training run, every role a real process started
through the CLI: ``streamrl up --durable`` (which restarts its server from the AOF on the same
port), rq rollout and verify workers, ``streamrl produce`` and ``streamrl learn``. Each role
must ride out the restarts, and the run must end with every prompt pushed once, scored into
exactly one group and consumed by the learner exactly once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import redis

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import xrange_all
from streamrl.bus.values import id_order
from streamrl.defaults import LEARNER_GROUP, ROLLOUT_QUEUE, VERIFY_QUEUE
from streamrl.local.procs import WorkerProcs
from streamrl.models.tiny import save_tiny
from tests.support.waiting import wait_for

RUN = "restart"
PROMPTS, GROUP = 96, 4
RESTART_AT = (24, 60)  # groups the learner has taken when Redis is killed

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


def _pid(run_dir: Path) -> int:
    return int((run_dir / "redis.pid").read_text())


def test_every_role_rides_out_redis_restarts(subprocess_env, tmp_path):
    env = {**subprocess_env, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    model = save_tiny(tmp_path / "model")
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(CONFIG.format(run=RUN, group=GROUP, model=model, out=tmp_path / "learner"))
    run_dir = tmp_path / "rd"
    logs = tmp_path / "logs"
    logs.mkdir()
    cli = [sys.executable, "-m", "streamrl.cli", "--run-dir", str(run_dir)]

    def start(name: str, *argv: str) -> subprocess.Popen:
        out = open(logs / f"{name}.log", "wb")  # noqa: SIM115 - lives with the process
        return subprocess.Popen([*cli, *argv], stdout=out, stderr=subprocess.STDOUT, env=env)

    up = start("up", "up", "--durable")
    procs = None
    others: list[subprocess.Popen] = []
    try:
        wait_for(lambda: (run_dir / "redis.url").exists(), "streamrl up", 30)
        url = (run_dir / "redis.url").read_text().strip()
        r = redis.Redis.from_url(url)
        keys = Keys(RUN)
        procs = WorkerProcs(url, log_dir=logs, env=env)
        procs.start(ROLLOUT_QUEUE, 1)
        procs.start(VERIFY_QUEUE, 1)
        producer = start("produce", "--redis", url, "produce", "--config", str(cfg_path),
                         "--count", str(PROMPTS))  # fmt: skip
        learner = start("learn", "--redis", url, "learn", "--config", str(cfg_path),
                        "--exit-when-idle", "15")  # fmt: skip
        others = [producer, learner]

        def learner_field(name: str) -> int:
            return int(float(r.hget(keys.learner, name) or 0))

        steps_at_kill = []
        for at in RESTART_AT:
            wait_for(lambda at=at: learner_field("groups_consumed") >= at, f"{at} groups", 180)
            old = _pid(run_dir)
            steps_at_kill.append(learner_field("step"))
            os.kill(old, signal.SIGKILL)  # a crash: `up --durable` brings it back from its AOF
            wait_for(
                lambda old=old: _pid(run_dir) != old and r.ping(),
                "Redis back",
                30,
                ignore=(redis.ConnectionError,),
            )
        assert learner.wait(timeout=300) == 0, (logs / "learn.log").read_text()[-3000:]
        assert producer.wait(timeout=60) == 0, (logs / "produce.log").read_text()[-3000:]
        assert up.poll() is None, "streamrl up gave up on its server"

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
        final = json.loads((logs / "learn.log").read_text().strip().splitlines()[-1])
        assert learner_field("groups_consumed") == PROMPTS  # committed + open window
        pending = r.xpending_range(keys.groups, LEARNER_GROUP, "-", "+", PROMPTS)
        assert final["counters"]["groups_consumed"] + len(pending) == PROMPTS, final
        assert all(id_order(p["message_id"].decode()) > id_order(final["last_id"]) for p in pending)
        assert final["step"] > steps_at_kill[-1], (final, steps_at_kill)
        r.close()
    finally:
        for p in others:
            if p.poll() is None:
                p.kill()
                p.wait()
        if procs is not None:
            procs.stop(timeout=10)
        up.send_signal(signal.SIGTERM)  # stops its redis-server too
        up.wait(timeout=30)
