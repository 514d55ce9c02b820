"""One run across nodes: a run split into three shards on a real three-master Redis Cluster.
Each shard's keys share one slot, the shards land on different masters, prompts spread over
them, workers consume them all, and every sample comes out exactly once."""

from __future__ import annotations

import json

import pytest
import redis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from streamrl.bus.keys import Keys, shard_keys
from streamrl.config import RolloutConfig, RunConfig, StreamConfig, VerifyConfig
from streamrl.envs import make_env
from streamrl.local.pipeline import LocalPipeline, task_ids, xrange_all
from streamrl.ops.drift import drift_report
from streamrl.ops.views import RewardFeed
from streamrl.producer.produce import Producer
from streamrl.schema import GROUP
from tests.support.cli import run_cli

RUN = "nodes"
SHARDS = 3


def _slot(r, key: str) -> int:
    return int(r.execute_command("CLUSTER", "KEYSLOT", key))


def test_keys_of_one_shard_share_a_slot_and_unsharded_names_are_unchanged():
    assert shard_keys(RUN, 1) == [Keys(RUN)]  # shards = 1: today's names, no shard index
    assert Keys(RUN).tasks == "srl:{nodes}:tasks"
    # CRC16 puts {nodes:1} in slot 9136, the middle of the second third: kept as it is;
    # {nodes:2} (5075) is not in the last third, so shard 2 takes the first tag that is
    assert Keys(RUN, 1, 3).tasks == "srl:{nodes:1}:tasks"
    assert Keys(RUN, 2, 3).tasks == "srl:{nodes:2:4}:tasks"
    assert Keys(RUN, 2, 3).config == Keys(RUN).config == "srl:{nodes}:config"  # run-wide keys
    with pytest.raises(ValueError, match="shard 3 of a run with 3"):
        Keys(RUN, 3, 3)


@pytest.mark.parametrize("shards", [2, 3, 4, 5, 8, 16])
def test_shard_tags_spread_over_the_slot_space_whatever_the_run_is_called(shards):
    """Shard s of N hashes into the middle half of the sth Nth of the 16384 slots, so N
    shards land on N different masters of a balanced N-master cluster, for any run name."""
    width = REDIS_CLUSTER_HASH_SLOTS / shards
    for run in ("nodes", "default", "exp-42", "a", "zz:top"):
        slots = [key_slot(k.tasks.encode()) for k in shard_keys(run, shards)]
        for s, slot in enumerate(slots):
            assert (s + 0.25) * width <= slot < (s + 0.75) * width, (run, s, slot)


def test_sharded_run_spreads_over_nodes_and_loses_nothing(
    redis_cluster, cluster_urls, subprocess_env, tmp_path
):
    data_url, control_url = cluster_urls
    cfg = RunConfig(
        run=RUN,
        env="counter",
        group_size=2,
        env_options={"steps": 1},
        streams=StreamConfig(shards=SHARDS),
        # short leases, so that two rollout workers and one verifier take turns on all shards
        rollout=RolloutConfig(lease_seconds=2, drain_seconds=2),
        verify=VerifyConfig(lease_seconds=2),
    )
    with LocalPipeline(
        cfg, url=data_url, control_url=control_url, directory=tmp_path, worker_env=subprocess_env
    ) as p:
        node = redis.Redis(port=redis_cluster.ports[0])
        # every key a script touches in one shard hashes to that shard's slot ...
        slots = []
        for k in p.shards:
            keys = [k.tasks, k.rollouts, k.scored, k.groups, k.dead, k.stats]
            keys += [k.session("x:0"), k.group("x"), k.producer("src")]
            assert len({_slot(node, key) for key in keys}) == 1
            slots.append(_slot(node, k.tasks))
        # ... and the three shards live on three different masters
        owners = [redis_cluster.node_of(k.tasks) for k in p.shards]
        assert len(set(slots)) == SHARDS and sorted(owners) == sorted(redis_cluster.ports)

        p.start_workers(rollout=2, verify=1)
        res = Producer(p.r, RUN).from_env(make_env("counter", steps=1), 30, 2, seed=8)
        assert res.samples == 60
        p.wait_groups(30, settled=False, timeout=120)
        acc = p.account(task_ids("counter", 8, 30, 2))
        per_shard = [[GROUP.decode(f[b"p"]).prompt_id for _, f in xrange_all(p.r, k.groups)]
                     for k in p.shards]  # fmt: skip
        # the live reward feed and re-verification read every shard
        rewards = RewardFeed(p.r, RUN, start="0-0").poll()
        drift = drift_report(p.r, RUN)
        # the data is physically on each shard's own master
        for k, port in zip(p.shards, owners, strict=True):
            assert redis.Redis(port=port).xlen(k.groups) == 10
        shown = run_cli(
            ["--redis", data_url, "--control-redis", control_url, "--run", RUN, "status", "--json"],
            subprocess_env,
        )
        base = ["--redis", data_url, "--control-redis", control_url, "--run", RUN]
        replayed = run_cli([*base, "replay", "learner", "--from", "1-0"], subprocess_env)
    assert acc.lost == 0 and acc.duplicated == 0 and acc.failures == 0
    assert acc.groups == 30 and acc.malformed_groups == 0
    assert len(rewards) == 60 and drift["samples"] == 60
    # prompt i went to shard i mod 3: ten prompts each
    for s, prompts in enumerate(per_shard):
        assert sorted(int(pid.rsplit("-", 1)[1]) % SHARDS for pid in prompts) == [s] * 10
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["groups_completed"] == 30 and info["trajectories"] == 60
    assert [info["shards"][str(s)]["groups_completed"] for s in range(SHARDS)] == [10] * 3
    # status names the master serving each shard, and the run's own keys
    assert [info["shards"][str(s)]["node"] for s in range(SHARDS)] == [
        f"127.0.0.1:{port}" for port in owners
    ]
    assert info["redis"]["node"] == f"127.0.0.1:{redis_cluster.node_of(Keys(RUN).config)}"
    assert info["stages"]["groups"]["length"] == 30
    assert replayed.returncode == 2 and "--shard" in replayed.stderr


def test_cli_keeps_a_runs_shards_and_replays_per_shard(
    redis_cluster, cluster_urls, subprocess_env, tmp_path
):
    data_url, control_url = cluster_urls
    base = ["--run-dir", str(tmp_path / "rd"), "--redis", data_url]
    base += ["--control-redis", control_url, "--run", "clsh"]
    produce = [*base, "produce", "--env", "counter", "--group-size", "2"]
    first = run_cli([*produce, "--count", "3", "--shards", "3"], subprocess_env)
    assert first.returncode == 0, first.stderr
    more = run_cli([*produce, "--count", "6"], subprocess_env)  # keeps the run's 3 shards
    assert more.returncode == 0 and "pushed 3 prompts" in more.stdout, more.stderr
    other = run_cli([*produce, "--count", "9", "--shards", "2"], subprocess_env)
    assert other.returncode == 1 and "has 3 shards" in other.stderr
    r = redis_cluster.client()
    clsh = shard_keys("clsh", 3)
    assert [r.xlen(k.tasks) for k in clsh] == [4, 4, 4]
    every = run_cli([*base, "replay", "rollout", "--from", "$"], subprocess_env)
    assert every.returncode == 0 and every.stdout.count("will re-read") == 3
    one = run_cli([*base, "replay", "rollout", "--shard", "1", "--from", "1-0"], subprocess_env)
    assert one.returncode == 0 and "{" + clsh[1].tag + "}" in one.stdout
    assert r.xinfo_groups(clsh[1].tasks)[0]["last-delivered-id"] == b"1-0"
    assert r.xinfo_groups(clsh[0].tasks)[0]["lag"] == 0  # moved to $ before
    bad = run_cli([*base, "replay", "rollout", "--shard", "3"], subprocess_env)
    assert bad.returncode == 2 and "shards 0..2" in bad.stderr
