"""Liveness by construction: whatever dies, and whenever, the run drains with nothing lost.

The randomized test prints its seed on failure; rerun it with STREAMRL_CHAOS_SEED=<seed>.
"""

from __future__ import annotations

import json
import os
import random

import redis
from rq import Queue
from rq.serializers import JSONSerializer

from streamrl.benchmarks.chaos import ChaosConfig, chaos_bench, clean
from streamrl.config import PolicyConfig, RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.defaults import ROLLOUT_QUEUE, VERIFY_QUEUE
from streamrl.envs import make_env
from streamrl.local.embedded import EmbeddedRedis
from streamrl.local.pipeline import LocalPipeline, task_ids
from streamrl.ops.status import collect
from streamrl.producer.produce import Producer
from tests.support.waiting import wait_for

FAST = StreamConfig(claim_idle_ms=1500, heartbeat_s=0.3, max_deliveries=30)


def test_random_kills_and_a_redis_restart_lose_nothing(subprocess_env, tmp_path):
    seed = int(os.environ.get("STREAMRL_CHAOS_SEED", random.randrange(1 << 30)))
    cfg = ChaosConfig(
        prompts=120,
        rollout_workers=3,
        verify_workers=2,
        max_concurrent=8,
        kills=22,
        redis_restart=True,
        seed=seed,
        timeout_s=300,
    )
    rerun = f"seed {seed} (rerun with STREAMRL_CHAOS_SEED={seed})"
    try:
        report = chaos_bench(cfg, directory=tmp_path, worker_env=subprocess_env)
    except Exception as e:  # the harness itself stopped: the seed still matters
        raise AssertionError(f"{rerun}: {type(e).__name__}: {e}") from e
    summary = {k: v for k, v in report.items() if k != "faults"}
    why = f"{rerun}: {json.dumps(summary)}"
    assert report["kills"] >= 20, why
    assert report["redis_restarts"] == 1, why
    assert set(report["kill_kinds"]) >= {"tree", "main", "horse"}, why
    assert report["drained"], why
    assert report["lost"] == 0 and report["duplicated"] == 0, why
    assert report["prompts"] >= cfg.prompts, why
    assert report["prompts_with_one_group"] == report["prompts"], why
    assert report["rewards_not_1"] == 0 and report["failures"] == 0, why
    assert report["dead_letters"] == 0, why
    assert clean(report), why


def _queue(r: redis.Redis, name: str) -> Queue:
    return Queue(name, connection=r, serializer=JSONSerializer)


def test_workers_start_leases_themselves_when_every_lease_is_gone(
    redis_url, subprocess_env, tmp_path
):
    """No lease queued and every lease killed with its worker: the workers that are started
    afterwards must find the work on their own (the chain of leases used to be the only way)."""
    cfg = RunConfig(
        run="no-lease",
        env="counter",
        group_size=4,
        env_options={"steps": 2},
        policy=PolicyConfig(latency_s=0.2, wrong_rate=0.0),
        rollout=RolloutConfig(lease_seconds=30, max_concurrent=8),
        verify=VerifyConfig(lease_seconds=30),
        streams=FAST,
    )
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        # workers started with no lease queued for them (LocalPipeline.start_workers would)
        p.procs.start(ROLLOUT_QUEUE, 2)
        p.procs.start(VERIFY_QUEUE, 1)
        Producer(p.r, cfg.run).from_env(make_env("counter", steps=2), 40, 4, seed=3)
        p.wait_groups(5, timeout=60)
        # kill every worker of both roles while they hold work, and empty the queues
        for _, proc in list(p.procs.procs):
            p.procs.kill(proc)
            proc.wait()
        for q in (ROLLOUT_QUEUE, VERIFY_QUEUE):
            _queue(p.r, q).empty()
        assert p.stat("groups_completed") < 40
        p.procs.start(ROLLOUT_QUEUE, 1)
        p.procs.start(VERIFY_QUEUE, 1)
        p.wait_groups(40, timeout=120)
        acc = p.account(task_ids("counter", 3, 40, 4))
    assert acc.lost == 0 and acc.duplicated == 0 and acc.groups == 40
    assert p.r.xlen(p.keys.dead) == 0


def test_status_counts_only_live_workers(redis_url, subprocess_env, tmp_path):
    cfg = RunConfig(run="live", env="counter", streams=FAST)
    with LocalPipeline(cfg, url=redis_url, directory=tmp_path, worker_env=subprocess_env) as p:
        a, _ = p.procs.start(VERIFY_QUEUE, 2)
        registered = lambda: collect(p.r, cfg.run)["rq"][VERIFY_QUEUE]["workers"] >= 2  # noqa: E731
        wait_for(registered, "the workers to register", 60, every=0.1)
        p.procs.kill(a)
        a.wait()
        # what a minute of silence looks like to rq: the dead worker's last heartbeat is old
        dead_name = next(name for name, proc in p.procs.procs if proc is a)
        p.r.hset(f"rq:worker:{dead_name}", "last_heartbeat", "2000-01-01T00:00:00.000000Z")
        rq_view = collect(p.r, cfg.run)["rq"][VERIFY_QUEUE]
    assert rq_view["registered"] == 2
    assert rq_view["workers"] == 1


def test_durable_redis_comes_back_on_its_port_with_its_data(tmp_path):
    first = EmbeddedRedis(tmp_path, durable=True).start()
    try:
        client = redis.Redis.from_url(first.url)
        client.xadd("s", {"k": "v"})
        client.close()
        port = first.port
        first.kill()
        again = EmbeddedRedis(tmp_path, durable=True)  # a new process would do this
        assert again.port == port
        again.start()
        client = redis.Redis.from_url(again.url)
        assert client.xlen("s") == 1
        client.close()
        again.stop()
    finally:
        first.stop()


def test_idle_workers_queue_leases_only_for_runs_with_work(r):
    """A run with nothing to do gets no lease (it would only take turns on the workers with the
    runs that have work); one with undelivered or unacked entries gets exactly one per queue."""
    from streamrl.bus.keys import Keys
    from streamrl.bus.streams import ensure_groups
    from streamrl.workers.context import write_config
    from streamrl.workers.lease_worker import ensure_leases

    for run in ("busy", "idle", "halted"):
        write_config(r, RunConfig(run=run))
        ensure_groups(r, Keys(run))
    r.xadd(Keys("busy").tasks, {"p": b"x"})
    r.xadd(Keys("halted").tasks, {"p": b"x"})
    r.set(Keys("halted").halt, 1)
    queues = [ROLLOUT_QUEUE, VERIFY_QUEUE]
    assert ensure_leases(r, queues) == 1
    assert ensure_leases(r, queues) == 0  # one waiting is enough
    (job,) = _queue(r, ROLLOUT_QUEUE).get_jobs()
    assert job.args[0] == "busy" and _queue(r, VERIFY_QUEUE).count == 0
    # delivered but never acked (its worker died) is work too
    _queue(r, ROLLOUT_QUEUE).empty()
    r.xreadgroup("rollout", "dead-worker", {Keys("busy").tasks: ">"})
    assert ensure_leases(r, queues) == 1
    # a run whose config is gone is unlisted
    r.delete(Keys("idle").config)
    ensure_leases(r, queues)
    assert b"idle" not in r.smembers("srl:runs")


def test_a_lease_may_run_as_long_as_its_run_config_says(r):
    """rq kills a horse past the job timeout: it must cover the configured lease, not the
    default one (the demo's 600 s rollout leases were killed at 180 s, mid-episode)."""
    from streamrl.bus.keys import Keys
    from streamrl.bus.streams import ensure_groups
    from streamrl.defaults import LEASE_JOB_TIMEOUT_GRACE
    from streamrl.workers.context import write_config
    from streamrl.workers.lease_worker import ensure_leases

    cfg = RunConfig(
        run="long",
        rollout=RolloutConfig(lease_seconds=600, drain_seconds=20),
        verify=VerifyConfig(lease_seconds=400),
    )
    write_config(r, cfg)
    ensure_groups(r, Keys("long"))
    r.xadd(Keys("long").tasks, {"p": b"x"})
    r.xadd(Keys("long").rollouts, {"p": b"x"})
    assert ensure_leases(r, [ROLLOUT_QUEUE, VERIFY_QUEUE]) == 2
    (rollout,) = _queue(r, ROLLOUT_QUEUE).get_jobs()
    (verify,) = _queue(r, VERIFY_QUEUE).get_jobs()
    assert rollout.timeout == 600 + 20 + LEASE_JOB_TIMEOUT_GRACE
    assert verify.timeout >= 400 + LEASE_JOB_TIMEOUT_GRACE
