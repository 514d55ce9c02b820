"""How ``streamrl worker`` starts: while Redis is down it waits (saying so once, and once
again when Redis answers) instead of exiting; before its run exists it takes no lease, and a
lease queued for the run's unsharded streams ends at once when the run turns out sharded."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import redis

from streamrl.bus.keys import Keys, shard_keys
from streamrl.bus.shards import NO_SUCH_SHARD
from streamrl.defaults import ROLLOUT_QUEUE, VERIFY_QUEUE
from streamrl.local.embedded import EmbeddedRedis, free_port
from streamrl.local.procs import stop_all
from streamrl.workers import leases
from tests.support.cli import ROOT, run_cli
from tests.support.waiting import wait_for


def _worker(argv: list[str], env: dict, log: Path) -> subprocess.Popen:
    return _started([sys.executable, "-m", "streamrl.cli", *argv], env, log)


def _started(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _live(r: redis.Redis, queue: str) -> int:
    return leases.queue_health(r, queue)["workers"]


def test_worker_started_while_redis_is_down_waits_for_it(subprocess_env, tmp_path):
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    log = tmp_path / "worker.log"
    proc = _worker(["--redis", url, "--run", "w", "worker", "rollout"], subprocess_env, log)
    try:
        said = lambda: log.read_text(errors="replace")  # noqa: E731
        wait_for(lambda: "waiting for it, retrying with backoff" in said(), said, 60)
        assert proc.poll() is None, said()
        with EmbeddedRedis(tmp_path / "redis", port=port):
            r = redis.Redis.from_url(url)
            wait_for(lambda: _live(r, ROLLOUT_QUEUE) == 1, said, 90, ignore=(redis.RedisError,))
            assert f"Redis at {url} answers after" in said()
            assert proc.poll() is None, said()
            stop_all([proc])
    finally:
        stop_all([proc])


def test_an_rq_worker_streamrl_starts_while_redis_is_down_waits_for_it(subprocess_env, tmp_path):
    """The command ``LocalPipeline`` (the demo, the chaos harness) starts workers with: rq's
    own command line reads Redis before it makes the worker class, and such a worker, started
    moments before a Redis restart, exited 1 at that first read (``Error 111 connecting``)."""
    from streamrl.local.procs import rq_worker_cmd

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    log = tmp_path / "worker.log"
    proc = _started(rq_worker_cmd(url, ROLLOUT_QUEUE, "w-down"), subprocess_env, log)
    try:
        said = lambda: log.read_text(errors="replace")  # noqa: E731
        # its imports done and its first connection refused, several times over
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=8)
        assert proc.poll() is None, said()
        with EmbeddedRedis(tmp_path / "redis", port=port):
            r = redis.Redis.from_url(url)
            wait_for(lambda: _live(r, ROLLOUT_QUEUE) == 1, said, 90, ignore=(redis.RedisError,))
            assert proc.poll() is None, said()
            stop_all([proc])
    finally:
        stop_all([proc])


def test_workers_started_before_a_sharded_run_wait_for_it(redis_url, subprocess_env, tmp_path):
    run = "early"
    r = redis.Redis.from_url(redis_url)
    base = ["--redis", redis_url, "--run", run]
    logs = {role: tmp_path / f"{role}.log" for role in ("rollout", "verify")}
    procs = [_worker([*base, "worker", role], subprocess_env, logs[role]) for role in logs]
    said = lambda: "".join(p.read_text(errors="replace") for p in logs.values())  # noqa: E731
    try:
        wait_for(lambda: _live(r, ROLLOUT_QUEUE) == 1 and _live(r, VERIFY_QUEUE) == 1, said, 90)
        assert said().count(f"run {run!r} has no config yet") == 2
        assert not r.keys(f"srl:{{{run}*")  # no stream, no group, no lease for it
        assert leases.queue(r, ROLLOUT_QUEUE).count == 0
        # a lease for the run's unsharded streams, as a worker of an older version queued
        # (or one racing the producer): it waits for the run's config
        leases.top_up(r, ROLLOUT_QUEUE, run)
        wait_for(lambda: leases.queue(r, ROLLOUT_QUEUE).count == 0, said, 60)  # taken
        made = run_cli(
            [*base, "produce", "--env", "counter", "--count", "12", "--group-size", "2",
             "--shards", "3"],
            subprocess_env,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        shards = shard_keys(run, 3)
        done = lambda: sum(int(r.hget(k.stats, "groups_completed") or 0) for k in shards)  # noqa: E731
        wait_for(lambda: done() == 12, said, 180)
        assert NO_SUCH_SHARD in said()  # the unsharded lease ended as the config showed up
        assert not r.exists(Keys(run).tasks) and not r.exists(Keys(run).rollouts)
        assert [int(r.hget(k.stats, "groups_completed")) for k in shards] == [4, 4, 4]
        # one worker per role, three shards: each left a drained shard's lease for the next
        # shard's waiting one instead of idling out the lease's 30 s (leases.IdleYield)
        for role, log in logs.items():
            assert log.read_text().count("lease ends early") >= 2, (role, said())
    finally:
        stop_all(procs)
