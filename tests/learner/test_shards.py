"""A sharded run on a real Redis Cluster: the learner reads every shard's groups, and a
learner SIGKILLed between its checkpoint and its acks, then restarted, applies every group
exactly once (per-shard last IDs in the checkpoint)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import msgspec
import torch
from groupdata import make_groups

from streamrl import schema
from streamrl.bus.keys import shard_keys
from streamrl.bus.streams import ensure_groups
from streamrl.bus.values import id_order
from streamrl.config import RunConfig, StreamConfig
from streamrl.connection import connect
from streamrl.defaults import LEARNER_GROUP
from streamrl.learner._failpoints import ENV as FAILPOINT_ENV
from streamrl.learner.config import load_learner_config
from streamrl.learner.loop import run_learner
from streamrl.workers.context import write_config

SHARDS = 3
CONFIG = """
run = "{run}"

[streams]
shards = 3

[learner]
model = "{model}"
output_dir = "{out}"
seed = 3
torch_threads = 1
batch_groups = 2
max_staleness = 100
lr = 1e-3
checkpoint_every = 2
sync_every = 100
block_ms = 100
"""


def test_sharded_learner_is_exactly_once_across_shards(
    redis_cluster, tiny_dir, tmp_path, subprocess_env
):
    redis_cluster.flush()
    url, run = redis_cluster.url, "lsh"
    r = connect(url)
    write_config(r, RunConfig(run=run, streams=StreamConfig(shards=3)))
    shards = shard_keys(run, 3)
    ids: list[list[str]] = [[], [], []]
    for k in shards:
        ensure_groups(r, k)
    for i, g in enumerate(make_groups(tiny_dir, 12, seed=4)):
        k = shards[i % 3]
        ids[i % 3].append(r.xadd(k.groups, {"id": g.prompt_id, "p": schema.encode(g)}).decode())
    cfg = tmp_path / "learn.toml"
    cfg.write_text(CONFIG.format(run=run, model=tiny_dir, out=tmp_path / "out"))
    cmd = [
        sys.executable, "-m", "streamrl.cli.learn", "--config", str(cfg),
        "--redis", url, "--exit-when-idle", "0.5",
    ]  # fmt: skip

    # killed right after its step-2 checkpoint, before acking what it covers
    killed = subprocess.run(
        cmd, env={**subprocess_env, FAILPOINT_ENV: "after_checkpoint@2"}, capture_output=True
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-3000:]
    held = sum(r.xpending(k.groups, LEARNER_GROUP)["pending"] for k in shards)
    assert held > 0  # the crash left covered entries unacked

    # the restart, in this process (on a thread: no signal handlers), saves a torch start-up
    threads = torch.get_num_threads()
    box: dict = {}
    learn = load_learner_config(cfg)
    t = threading.Thread(
        target=lambda: box.update(
            state=run_learner(url, run, learn, exit_when_idle=0.5, shards=SHARDS)
        )
    )
    t.start()
    t.join(120)
    torch.set_num_threads(threads)
    state = msgspec.to_builtins(box["state"])

    acked = 0
    for s, k in enumerate(shards):
        pending = [
            p["message_id"].decode()
            for p in r.xpending_range(k.groups, LEARNER_GROUP, "-", "+", 100)
        ]
        last = state["last_ids"].get(str(s))
        # entries up to the shard's last covered id are acked, the rest (a part-filled batch at
        # exit) are pending, newer than it
        covered = [i for i in ids[s] if last is not None and id_order(i) <= id_order(last)]
        assert set(covered).isdisjoint(pending)
        assert set(pending) == set(ids[s]) - set(covered)
        acked += len(ids[s]) - len(pending)
    assert set(state["last_ids"]) == {"0", "1", "2"}  # every shard was read
    # each acked group counted once: the restart skipped what the checkpoint covered
    assert state["counters"]["groups_consumed"] == acked
    assert acked >= 9
