"""A Redis whose maxmemory-policy may delete keys is refused by every role at its start, with
one line that says why and how to fix it; ``--allow-eviction`` runs anyway, loudly. Against a
real redis-server set to ``allkeys-lru``, each role a real process."""

from __future__ import annotations

import json
import subprocess

import pytest
import redis

from streamrl.bus import eviction
from streamrl.defaults import ROLLOUT_QUEUE
from streamrl.local.embedded import EmbeddedRedis
from streamrl.local.procs import rq_worker_cmd
from tests.support.cli import ROOT, run_cli

WHY = "Redis maxmemory-policy is not noeviction (allkeys-lru)"


@pytest.fixture
def evicting_url(tmp_path):
    """A redis-server of its own, set to evict any key under memory pressure."""
    with EmbeddedRedis(tmp_path / "redis") as server:
        client = redis.Redis.from_url(server.url)
        client.config_set("maxmemory-policy", "allkeys-lru")
        client.close()
        yield server.url


def _one_line_refusal(proc: subprocess.CompletedProcess) -> str:
    """The refusal is the last line on stderr, the process failed, and no traceback shows."""
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert WHY in last and "CONFIG SET maxmemory-policy noeviction" in last, last
    assert "--allow-eviction" in last and eviction.ENV_ALLOW in last, last
    return last


def test_every_role_refuses_an_evicting_redis(evicting_url, subprocess_env, tmp_path):
    base = ["--run-dir", str(tmp_path / "rd"), "--redis", evicting_url, "--run", "ev"]
    produce = run_cli([*base, "produce", "--env", "counter", "--count", "2"], subprocess_env)
    _one_line_refusal(produce)
    worker = run_cli([*base, "worker", "rollout"], subprocess_env, timeout=60)
    _one_line_refusal(worker)
    # an rq worker started without `streamrl worker`: the worker class refuses as it is made
    rq = subprocess.run(
        [*rq_worker_cmd(evicting_url, ROLLOUT_QUEUE), "--burst"],
        env=subprocess_env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    _one_line_refusal(rq)
    model = tmp_path / "model"  # the refusal comes before any model is loaded
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = tmp_path / "learn.toml"
    config.write_text(f'run = "ev"\n[learner]\nmodel = "{model}"\noutput_dir = "{tmp_path}"\n')
    learn = run_cli([*base, "learn", "--config", str(config)], subprocess_env)
    _one_line_refusal(learn)
    # nothing was written: no role got as far as its run
    assert redis.Redis.from_url(evicting_url).dbsize() == 0
    # status refuses nothing: it shows what is wrong
    shown = run_cli([*base, "status", "--json"], subprocess_env)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)["redis"]
    assert info["maxmemory_policy"] == {"": "allkeys-lru"} and WHY in info["eviction"]


def test_allow_eviction_runs_anyway_and_says_so(evicting_url, subprocess_env, tmp_path):
    base = ["--run-dir", str(tmp_path / "rd"), "--redis", evicting_url, "--run", "ev"]
    made = run_cli(
        ["--allow-eviction", *base, "produce", "--env", "counter", "--count", "2"],
        subprocess_env,
    )
    assert made.returncode == 0, made.stderr
    assert "pushed 2 prompts" in made.stdout
    assert "RUNNING ON AN EVICTING REDIS" in made.stderr and WHY in made.stderr
    env = {**subprocess_env, eviction.ENV_ALLOW: "1"}  # the same through the environment
    more = run_cli([*base, "produce", "--env", "counter", "--count", "3"], env)
    assert more.returncode == 0 and "pushed 1 prompts" in more.stdout, more.stderr


def test_noeviction_passes_and_every_master_of_a_cluster_is_read(redis_cluster, redis_url):
    from streamrl.connection import connect

    plain = connect(redis_url)
    assert eviction.policies(plain) == {"": "noeviction"} and eviction.check(plain, "t") is None
    cluster = connect(redis_cluster.url)
    found = eviction.policies(cluster)
    assert len(found) == len(redis_cluster.ports) and set(found.values()) == {"noeviction"}
    one = f"127.0.0.1:{redis_cluster.ports[1]}"
    redis.Redis(port=redis_cluster.ports[1]).config_set("maxmemory-policy", "volatile-lru")
    try:
        with pytest.raises(eviction.EvictingRedis, match=f"{one} has volatile-lru"):
            eviction.check(cluster, "t")
    finally:
        redis.Redis(port=redis_cluster.ports[1]).config_set("maxmemory-policy", "noeviction")
