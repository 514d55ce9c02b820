"""A full disk under the learner (``RLIMIT_FSIZE`` on its process: every file it writes fails
past a few bytes): policy versions that cannot be written are skipped and never announced,
the first checkpoint that cannot be written stops the learner with one ``Error:`` line and
nothing acked past the last complete checkpoint, and a restart with room again resumes from
that checkpoint and ends bitwise where an undisturbed learner ends."""

from __future__ import annotations

import resource
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import torch
from groupdata import feed, make_groups

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.learner.checkpoint import latest_checkpoint, read_state
from streamrl.learner.config import load_learner_config
from streamrl.learner.loop import run_learner

N_GROUPS = 16
FSIZE = 2048  # bytes: config.json fits, no weights file does

CONFIG = """
[learner]
model = "{model}"
output_dir = "{out}"
seed = 5
torch_threads = 1
batch_groups = 2
max_staleness = 100
lr = 3e-3
checkpoint_every = 2
sync_every = 1
keep_policy_versions = 20
block_ms = 100
"""


def _config(tmp_path: Path, model: Path, name: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(CONFIG.format(model=model, out=tmp_path / name))
    return path


def _versions(r, keys: Keys) -> list[int]:
    return [schema.POLICY_VERSION.decode(f[b"p"]).version for _, f in r.xrange(keys.policy)]


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE, FSIZE))


def test_a_full_disk_stops_the_learner_cleanly_and_a_restart_resumes(
    redis_url, r, tiny_dir, tmp_path, subprocess_env
):
    groups = make_groups(tiny_dir, N_GROUPS, seed=21)

    ref_keys = Keys("ref")
    ensure_groups(r, ref_keys)
    feed(r, ref_keys, groups)
    ref_cfg = load_learner_config(_config(tmp_path, tiny_dir, "ref"))
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(state=run_learner(redis_url, "ref", ref_cfg, exit_when_idle=0.5))
    )
    t.start()
    t.join(90)
    ref = box["state"]

    keys = Keys("full")
    ensure_groups(r, keys)
    feed(r, keys, groups)
    out = tmp_path / "full"
    cmd = [
        sys.executable, "-m", "streamrl.cli", "--redis", redis_url, "--run", "full", "learn",
        "--config", str(_config(tmp_path, tiny_dir, "full")),
    ]  # fmt: skip

    def learn(*extra: str, limit: bool = False) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*cmd, *extra], capture_output=True, text=True, env=subprocess_env, timeout=120,
            preexec_fn=_limit_file_size if limit else None,
        )  # fmt: skip

    first = learn("--total-steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    assert _versions(r, keys) == [0, 1, 2]

    full = learn("--exit-when-idle", "5", limit=True)
    assert full.returncode == 1, full.stderr[-3000:]
    assert "Traceback" not in full.stderr
    last = full.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: checkpoint of step 4 not written (")
    assert f"file size limit {FSIZE} bytes" in last
    assert "the last complete checkpoint is step-00000002" in last
    assert "policy version 3 not written (" in full.stderr  # skipped, training went on
    assert "policy version 4 not written (" in full.stderr
    # nothing half-written is left or announced, nothing acked past the checkpoint
    assert _versions(r, keys) == [0, 1, 2]
    assert sorted(p.name for p in (out / "policy").iterdir()) == ["v0", "v1", "v2"]
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-00000002"]
    assert r.hget(keys.learner, "status") == b"failed"
    assert r.hget(keys.learner, "last_checkpoint_step") == b"2"
    assert r.xpending(keys.groups, "learner")["pending"] == N_GROUPS - 4

    again = learn("--exit-when-idle", "0.5")
    assert again.returncode == 0, again.stderr[-3000:]
    started = next(line for line in again.stderr.splitlines() if "learner started" in line)
    assert "checkpoints/step-00000002" in started  # resumed from the last complete one
    state = read_state(latest_checkpoint(out / "checkpoints"))
    assert (state.step, state.policy_version) == (ref.step, ref.policy_version) == (8, 8)
    assert msgspec.structs.asdict(state.counters) == msgspec.structs.asdict(ref.counters)
    assert state.counters.groups_consumed == N_GROUPS  # each group once
    assert _versions(r, keys) == _versions(r, ref_keys) == list(range(9))
    ref_w = torch.load(latest_checkpoint(tmp_path / "ref" / "checkpoints") / "weights.pt")
    weights = torch.load(latest_checkpoint(out / "checkpoints") / "weights.pt")
    assert ref_w.keys() == weights.keys()
    assert all(torch.equal(ref_w[k], weights[k]) for k in ref_w)
    assert r.xpending(keys.groups, "learner")["pending"] == 0
