"""Exactly once: a learner SIGKILLed at random moments and restarted ends with bitwise the same
weights, counters and stream position as one that ran uninterrupted on the same groups."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import redis
import torch
from groupdata import feed, make_groups
from safetensors.torch import load_file

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.learner._failpoints import ENV as FAILPOINT_ENV
from streamrl.learner.checkpoint import latest_checkpoint, read_state
from streamrl.learner.config import load_learner_config
from streamrl.learner.loop import run_learner
from tests.support.waiting import wait_for

N_GROUPS = 40
VERSIONS = [i // 6 if i % 7 else 0 for i in range(N_GROUPS)]  # every 7th goes stale

CONFIG = """
[learner]
model = "{model}"
output_dir = "{out}"
seed = 3
torch_threads = 1
batch_groups = 2
max_staleness = 2
loss_type = "dapo"
importance_sampling = "token_truncate"
importance_sampling_max = 1.5
entropy_target = 100.0  # always above: the adaptive coefficient grows every step, so a restart
entropy_coef_step = 0.01  # that lost it would train on a different loss
lr = 3e-3
warmup_steps = 2
lr_schedule = "cosine"
total_steps = 40
checkpoint_every = 2
sync_every = 3
keep_policy_versions = 2
block_ms = 100
"""


def _config(tmp_path: Path, model: Path, name: str) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(CONFIG.format(model=model, out=tmp_path / name))
    return path


def _weights(out: Path) -> dict[str, torch.Tensor]:
    ckpt = latest_checkpoint(out / "checkpoints")
    assert ckpt is not None
    return torch.load(ckpt / "weights.pt", weights_only=True)


def _versions(r: redis.Redis, keys: Keys) -> list[int]:
    return [schema.POLICY_VERSION.decode(f[b"p"]).version for _, f in r.xrange(keys.policy)]


def test_sigkilled_learner_matches_uninterrupted_run(
    redis_url, r, tiny_dir, tmp_path, subprocess_env
):
    groups = make_groups(tiny_dir, N_GROUPS, seed=11, versions=VERSIONS)

    # The reference: one uninterrupted run (in this process, on a thread: no signal handlers).
    ref_keys = Keys("ref")
    ensure_groups(r, ref_keys)
    ref_ids = feed(r, ref_keys, groups)
    ref_cfg = load_learner_config(_config(tmp_path, tiny_dir, "ref"))
    threads = torch.get_num_threads()
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(state=run_learner(redis_url, "ref", ref_cfg, exit_when_idle=0.5))
    )
    t.start()
    t.join(60)
    torch.set_num_threads(threads)
    ref = box["state"]
    steps = ref.step
    assert steps >= 8 and ref.counters.dropped_stale > 0 and ref.counters.dropped_zero_variance > 0

    # The same groups, a learner process SIGKILLed at seeded random moments.
    keys = Keys("kill")
    ensure_groups(r, keys)
    ids = feed(r, keys, groups)
    cfg_path = _config(tmp_path, tiny_dir, "kill")
    cmd = [
        sys.executable, "-m", "streamrl.cli.learn", "--config", str(cfg_path),
        "--redis", redis_url, "--run", "kill", "--exit-when-idle", "0.5",
    ]  # fmt: skip
    log_path = tmp_path / "kill.log"
    log = open(log_path, "wb")  # noqa: SIM115

    def start(failpoint: str = "") -> subprocess.Popen:
        env = {**subprocess_env, FAILPOINT_ENV: failpoint}
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    # Crashes exactly inside the windows that matter (checkpoint every 2 steps, publish every 3):
    crashes = [
        "mid_checkpoint@4",  # checkpoint files written, not renamed into place
        "after_checkpoint@6",  # checkpoint in place, its entries not yet acked
        "after_policy_write@9",  # v3 on disk, not announced
        "after_announce@12",  # v4 announced, step 12 not checkpointed
    ]
    for point in crashes:
        proc = start(point)
        assert proc.wait(timeout=60) == -signal.SIGKILL, log_path.read_text()[-3000:]
    # ... and a SIGKILL from outside at a seeded random moment after a few more steps
    rng = random.Random(1234)
    target = rng.randint(13, steps - 1)
    proc = start()

    def at_target() -> bool:
        if (
            int(r.hget(keys.learner, "step") or 0) >= target
            and r.hget(keys.learner, "pid") == str(proc.pid).encode()
        ):
            return True
        assert proc.poll() is None, log_path.read_text()[-3000:]
        return False

    wait_for(at_target, f"the restarted learner to reach step {target}", 60, every=0.005)
    time.sleep(rng.uniform(0.0, 0.04))  # somewhere inside the next step
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc = start()
    assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    log.close()
    text = log_path.read_text()
    assert text.count("learner started") == len(crashes) + 2
    # each crash struck where intended: the next start restored the checkpoint before it
    restored = [line.split("step-")[1][:8] for line in text.splitlines() if "restored=/" in line]
    assert restored[:4] == ["00000002", "00000006", "00000008", "00000010"]

    state = read_state(latest_checkpoint(tmp_path / "kill" / "checkpoints"))
    ref_weights, weights = _weights(tmp_path / "ref"), _weights(tmp_path / "kill")
    assert ref_weights.keys() == weights.keys()
    for name, w in ref_weights.items():
        assert torch.equal(w, weights[name]), name
    initial = load_file(tiny_dir / "model.safetensors")
    assert not torch.equal(initial["lm_head.weight"], weights["lm_head.weight"])  # it trained
    assert msgspec.structs.asdict(state.counters) == msgspec.structs.asdict(ref.counters)
    assert state.entropy_coef == ref.entropy_coef  # bitwise: restored, not restarted from 0
    assert abs(ref.entropy_coef - min(0.3, 0.01 * ref.step)) < 1e-9
    # the same stream position: the same entry index is the last one the weights contain
    assert (state.step, state.policy_version, ids.index(state.last_id)) == (
        ref.step,
        ref.policy_version,
        ref_ids.index(ref.last_id),
    )
    c = state.counters
    assert c.groups_consumed == (
        c.groups_applied + c.dropped_stale + c.dropped_zero_variance + c.dropped_no_tokens
    )
    # everything the checkpoint covers is acked; only the trailing partial window is pending
    assert (
        r.xpending(keys.groups, "learner")["pending"]
        == r.xpending(ref_keys.groups, "learner")["pending"]
    )
    # each policy version was announced once, in order, despite replays
    assert _versions(r, keys) == _versions(r, ref_keys) == list(range(ref.policy_version + 1))
