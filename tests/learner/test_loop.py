"""The learner process end to end, in this process: drops and counters, the progress hash,
published versions (full and LoRA), checkpoints, and stopping at ``total_steps``."""

from __future__ import annotations

import msgspec
import pytest
import torch
from groupdata import feed, make_groups, run_learner_thread
from safetensors.torch import load_file

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.learner.checkpoint import latest_checkpoint
from streamrl.learner.config import LearnerConfig, load_learner_config

_run = run_learner_thread


def _cfg(tiny_dir, tmp_path, **kw) -> LearnerConfig:
    base = dict(
        model=str(tiny_dir), output_dir=str(tmp_path / "out"), torch_threads=1, batch_groups=2,
        checkpoint_every=2, sync_every=1, keep_policy_versions=2, lr=1e-3, block_ms=100,
    )  # fmt: skip
    return LearnerConfig(**{**base, **kw})


def test_drops_counts_publishes_and_reports(redis_url, r, tiny_dir, tmp_path):
    keys = Keys("loop")
    ensure_groups(r, keys)
    groups = make_groups(tiny_dir, 10, seed=5, versions=[0] * 6 + [5] * 4)
    same = msgspec.structs.replace(groups[1], samples=[groups[1].samples[0]] * 4)  # zero variance
    no_tokens = msgspec.structs.replace(
        groups[2],
        samples=[
            msgspec.structs.replace(
                s,
                trajectory=msgspec.structs.replace(
                    s.trajectory,
                    turns=[msgspec.structs.replace(t, token_ids=[]) for t in s.trajectory.turns],
                ),
            )
            for s in groups[2].samples
        ],
    )
    feed(r, keys, [groups[0], same, no_tokens, groups[3]])
    r.xadd(keys.groups, {"id": "junk", "p": b"not msgpack"})
    feed(r, keys, groups[4:])
    cfg = _cfg(tiny_dir, tmp_path, max_staleness=0)
    state = _run(redis_url, "loop", cfg, exit_when_idle=0.5)

    c = state.counters
    assert c.dropped_zero_variance >= 1 and c.dropped_no_tokens == 1 and c.dropped_invalid == 1
    assert c.dropped_stale >= 1  # version-0 groups once the learner has published v1
    assert c.groups_applied == 2 * state.step
    assert c.groups_consumed == (
        c.groups_applied + c.dropped_stale + c.dropped_zero_variance + c.dropped_no_tokens
        + c.dropped_invalid
    )  # fmt: skip
    assert state.policy_version == state.step  # sync_every = 1

    h = {k.decode(): v.decode() for k, v in r.hgetall(keys.learner).items()}
    for name in (
        "step", "policy_version", "groups_consumed", "groups_applied", "dropped_stale",
        "dropped_zero_variance", "samples_consumed", "last_checkpoint_step",
        "last_checkpoint_time", "reward_mean",
    ):  # fmt: skip
        assert name in h, name
    assert h["status"] == "stopped" and int(h["step"]) == state.step
    assert int(h["last_checkpoint_step"]) == state.step
    assert int(h["groups_consumed"]) == 11
    # what status shows: the share of consumed groups dropped per reason, and the entropy
    for reason in ("stale", "zero_variance", "no_tokens", "invalid"):
        frac = float(h[f"dropped_fraction_{reason}"])
        assert frac == pytest.approx(getattr(c, f"dropped_{reason}") / 11, abs=1e-4), reason
    assert 0 < float(h["entropy"]) < 10
    applied = msgspec.json.decode(h["applied_staleness"])
    assert sum(applied.values()) == c.groups_applied
    assert all(int(k) <= cfg.max_staleness for k in applied)  # < 0: sampled by a newer version
    assert c.is_tokens > 0 and 0 <= float(h["is_clipped_fraction"]) <= 1

    announced = [schema.POLICY_VERSION.decode(f[b"p"]) for _, f in r.xrange(keys.policy)]
    assert [pv.version for pv in announced] == list(range(state.step + 1))
    newest = announced[-1]
    assert newest.format == "safetensors" and newest.step == state.step
    policy = tmp_path / "out" / "policy"
    assert sorted(p.name for p in policy.iterdir()) == [
        f"v{state.step - 1}",
        f"v{state.step}",
    ]
    files = {p.name for p in (policy / f"v{state.step}").iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= files
    published = load_file(policy / f"v{state.step}" / "model.safetensors")
    ckpt = torch.load(latest_checkpoint(tmp_path / "out" / "checkpoints") / "weights.pt")
    assert all(torch.equal(published[n], w) for n, w in ckpt.items())
    initial = load_file(tiny_dir / "model.safetensors")
    assert not torch.equal(initial["lm_head.weight"], published["lm_head.weight"])

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(newest.path)  # a backend can load it


def test_lora_with_kl_publishes_adapter_only(redis_url, r, tiny_dir, tmp_path):
    keys = Keys("lora")
    ensure_groups(r, keys)
    feed(r, keys, make_groups(tiny_dir, 6, seed=2))
    cfg = _cfg(tiny_dir, tmp_path, lora_r=4, lora_alpha=8, beta=0.05, lr=1e-2)
    state = _run(redis_url, "lora", cfg, exit_when_idle=0.5)
    assert state.step >= 1
    pv = schema.POLICY_VERSION.decode(r.xrevrange(keys.policy, count=1)[0][1][b"p"])
    assert pv.format == "lora"
    vdir = tmp_path / "out" / "policy" / f"v{pv.version}"
    files = {p.name for p in vdir.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files
    assert "model.safetensors" not in files
    adapter = load_file(vdir / "adapter_model.safetensors")
    assert adapter and all("lora_" in n for n in adapter)
    assert any(float(w.abs().max()) > 0 for n, w in adapter.items() if "lora_B" in n)  # trained
    ckpt = torch.load(latest_checkpoint(tmp_path / "out" / "checkpoints") / "weights.pt")
    assert ckpt and all("lora_" in n for n in ckpt)


def test_total_steps_stops_and_leaves_the_rest_pending(redis_url, r, tiny_dir, tmp_path):
    keys = Keys("stop")
    ensure_groups(r, keys)
    feed(r, keys, make_groups(tiny_dir, 12, seed=9))
    cfg = _cfg(tiny_dir, tmp_path, total_steps=2, checkpoint_every=5)
    state = _run(redis_url, "stop", cfg)  # returns by itself
    assert state.step == 2 and state.checkpoint_step == 2  # checkpointed on the way out
    # what the steps consumed is acked; what was read beyond them stays pending for the next
    pending = r.xpending(keys.groups, "learner")["pending"]
    assert pending == 12 - state.counters.groups_consumed > 0
    # a later learner with more steps continues from the checkpoint and the stream position
    more = _cfg(tiny_dir, tmp_path, total_steps=3, checkpoint_every=5)
    again = _run(redis_url, "stop", more)
    assert again.step == 3
    assert again.counters.groups_consumed > state.counters.groups_consumed


def test_config_file(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text('env = "copy"\n[learner]\nmodel = "m"\nloss_type = "bnpo"\n')
    cfg = load_learner_config(path, total_steps=7)
    assert cfg.loss_type == "bnpo" and cfg.total_steps == 7 and cfg.eps_high == cfg.epsilon
    path.write_text('[learner]\nmodel = "m"\nloss_type = "ppo"\n')
    with pytest.raises(ValueError, match="loss_type"):
        load_learner_config(path)
    path.write_text('[learner]\nmodel = "m"\nlearning_rate = 1.0\n')
    with pytest.raises(ValueError, match="learning_rate"):
        load_learner_config(path)
