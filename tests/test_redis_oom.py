"""A Redis that fills up under ``noeviction``: with ``maxmemory`` lowered below what it holds in
the middle of a run, every write that may grow memory is refused (``OOM``). Real rq rollout and
verify workers, a producer and a learner training the tiny model back off instead of failing,
``status`` says Redis is full, and once memory is there again (``maxmemory`` raised) the run
completes with every prompt scored into exactly one group and taken by the learner once:
nothing lost or doubled, nothing dead-lettered, no failure scored."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import Counter

import torch

from streamrl import schema
from streamrl.bus.streams import xrange_all
from streamrl.bus.values import id_order
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.connection import connect
from streamrl.envs import make_env
from streamrl.learner.config import LearnerConfig
from streamrl.learner.loop import run_learner
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.models.tiny import save_tiny
from streamrl.ops.status import collect
from streamrl.producer.produce import Producer
from tests.support.waiting import wait_for

RUN = "oom"
FIRST, TOTAL, GROUP = 24, 64, 4
FULL_S = 6.0  # how long Redis stays full once every role has been refused
NEVER_STALE = 10**6


def _oom_errors(r) -> int:
    return int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


def test_roles_back_off_while_redis_is_full_and_the_run_completes(tmp_path, subprocess_env):
    cfg = RunConfig(
        run=RUN,
        env="counter",
        env_options={"steps": 2},
        group_size=GROUP,
        # token ids so that the learner trains; wrong answers so that groups have signal
        policy=PolicyConfig(latency_s=0.05, wrong_rate=0.25, options={"token_vocab": 24}),
        rollout=RolloutConfig(lease_seconds=4, max_concurrent=8, read_batch=8, max_policy_lag_s=0),
        learner={"max_staleness": NEVER_STALE},  # the scripted policy stays at version 0
        verify=VerifyConfig(lease_seconds=4),
        streams=StreamConfig(heartbeat_s=0.5, claim_idle_ms=3000),
    )
    env = make_env("counter", steps=2)
    # a Redis of its own (LocalPipeline starts one): CONFIG SET must not reach other tests
    with LocalPipeline(cfg, directory=tmp_path, worker_env=subprocess_env) as p:
        assert p.r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        p.start_workers(rollout=2, verify=1)
        p.wait_ready(2, 1)
        learner_cfg = LearnerConfig(
            model=str(save_tiny(tmp_path / "tiny")), output_dir=str(tmp_path / "learner"),
            device="cpu", torch_threads=1, batch_groups=4, checkpoint_every=2, block_ms=100,
            max_staleness=NEVER_STALE,
        )  # fmt: skip
        stop, box, threads = threading.Event(), {}, torch.get_num_threads()
        learner = threading.Thread(
            target=lambda: box.update(state=run_learner(p.url, RUN, learner_cfg, stop=stop))
        )
        learner.start()
        Producer(connect(p.url, resilient=True), RUN).from_env(env, FIRST, GROUP, seed=0)
        p.wait_groups(4)

        used = int(p.r.info("memory")["used_memory"])
        p.r.config_set("maxmemory", used // 2)  # full from now on
        # the producer pushes the rest while Redis is full: it waits, then goes on
        pushed = threading.Thread(
            target=lambda: Producer(connect(p.url, resilient=True), RUN).from_env(
                env, TOTAL, GROUP, seed=0
            )
        )
        pushed.start()
        full = wait_for(
            lambda: collect(p.r, RUN)["redis"]["full"], "status to say Redis is full", 30
        )
        wait_for(lambda: _oom_errors(p.r) >= 20, "the roles' writes to be refused", 60)
        cli = subprocess.run(
            [sys.executable, "-m", "streamrl.cli", "--redis", p.url, "--run", RUN, "status"],
            capture_output=True, text=True, env={**subprocess_env, "COLUMNS": "400"}, timeout=60,
        )  # fmt: skip
        time.sleep(FULL_S)
        refused = _oom_errors(p.r)
        alive_while_full = [proc.poll() for _, proc in p.procs.procs]
        p.r.config_set("maxmemory", 0)  # memory is there again

        pushed.join(120)
        assert not pushed.is_alive()
        p.wait_groups(TOTAL, timeout=180)
        wait_for(
            lambda: int(p.r.hget(p.keys.learner, "groups_consumed") or 0) >= TOTAL,
            "the learner to take every group", 120,
        )  # fmt: skip
        learner_alive = learner.is_alive()  # it rode out the refusals
        stop.set()
        learner.join(60)
        torch.set_num_threads(threads)  # run_learner set this process's torch_threads
        pending = [
            e["message_id"].decode()
            for e in p.r.xpending_range(p.keys.groups, "learner", "-", "+", TOTAL + 1)
        ]
        acc = p.account(task_ids("counter", 0, TOTAL, GROUP))
        per_prompt = Counter(
            schema.GROUP.decode(f[b"p"]).prompt_id for _, f in xrange_all(p.r, p.keys.groups)
        )
        dead = p.r.xlen(p.keys.dead)
        stats = p.r.hgetall(p.keys.stats)
        after = collect(p.r, RUN)["redis"]["full"]
        p.stop()

    assert full.startswith("Redis is full: used_memory ")
    assert cli.returncode == 0, cli.stderr
    assert "Redis is full" in cli.stdout
    assert refused >= 20
    assert alive_while_full == [None] * len(alive_while_full)  # no worker gave up
    assert after is None
    assert (acc.lost, acc.duplicated, acc.failures, acc.malformed_groups) == (0, 0, 0, 0)
    assert acc.scored == TOTAL * GROUP
    assert len(per_prompt) == TOTAL and set(per_prompt.values()) == {1}
    assert dead == 0
    assert int(stats.get(b"groups_completed", 0)) == TOTAL
    assert learner_alive
    state = box["state"]  # the learner stopped when told, not of an error
    # each group once: stepped on (checkpointed and acked), or read into the batch it was still
    # filling when told to stop (delivered, unacked, after the checkpoint: a restart redoes it)
    assert state.counters.groups_consumed + len(pending) == TOTAL
    assert all(id_order(i) > id_order(state.last_id) for i in pending)
    assert state.counters.groups_applied > 0 and state.step > 0
