"""The learner's ``report_to``: TensorBoard event files and an offline wandb run, read back
with their own readers, carrying every step's curves."""

from __future__ import annotations

import threading

import msgspec
import pytest
from groupdata import feed, make_groups

from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.learner.config import LearnerConfig, load_learner_config
from streamrl.learner.loop import run_learner
from streamrl.learner.report import targets
from tests.support import wandb_log

# what every step reports (TRL's names where TRL has one)
CURVES = (
    "train/loss", "train/reward", "train/reward_std", "train/entropy", "train/grad_norm",
    "train/learning_rate", "train/clip_ratio/low_mean", "train/clip_ratio/high_mean",
    "train/importance_weight/mean", "train/importance_weight/max",
    "train/importance_weight/clipped_fraction", "train/staleness/mean", "train/tokens_per_second",
)  # fmt: skip


def _train(redis_url, r, tiny_dir, tmp_path, run: str, report_to) -> tuple:
    """Train on 8 copy groups (some are dropped as zero-variance); the output dir and steps."""
    keys = Keys(run)
    ensure_groups(r, keys)
    feed(r, keys, make_groups(tiny_dir, 8, seed=7))
    cfg = LearnerConfig(
        model=str(tiny_dir), output_dir=str(tmp_path / "out"), torch_threads=1, batch_groups=2,
        checkpoint_every=10, lr=1e-3, block_ms=100, report_to=report_to,
    )  # fmt: skip
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(state=run_learner(redis_url, run, cfg, exit_when_idle=0.5))
    )
    t.start()
    t.join(180)
    steps = box["state"].step
    assert steps >= 2
    return tmp_path / "out", list(range(1, steps + 1))


def test_tensorboard_event_files_hold_every_step(redis_url, r, tiny_dir, tmp_path):
    pytest.importorskip("tensorboard", reason="pip install 'streamrl[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, steps = _train(redis_url, r, tiny_dir, tmp_path, "tb", "tensorboard")
    acc = EventAccumulator(str(out / "runs"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(CURVES) <= tags, set(CURVES) - tags
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == steps
    h = {k.decode(): v.decode() for k, v in r.hgetall(Keys("tb").learner).items()}
    assert loss[-1].value == pytest.approx(float(h["loss"]), rel=1e-5)
    lr = acc.Scalars("train/learning_rate")
    assert all(e.value == pytest.approx(1e-3) for e in lr)
    # rewards of real copy groups vary; weights near 1 (behaviour log-probs = model's + noise)
    assert all(e.value > 0 for e in acc.Scalars("train/reward_std"))
    assert all(0.3 < e.value < 3.0 for e in acc.Scalars("train/importance_weight/mean"))
    assert all(e.value > 0 for e in acc.Scalars("train/tokens_per_second"))


def test_wandb_offline_run_holds_every_step(redis_url, r, tiny_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="pip install 'streamrl[wandb]'")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is the default: no network
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    out, steps = _train(redis_url, r, tiny_dir, tmp_path, "wb", ["wandb"])
    (run_dir,) = (out / "wandb").glob("offline-run-*")
    (log_file,) = run_dir.glob("run-*.wandb")
    history = wandb_log.history(log_file)
    assert [row["_step"] for row in history] == steps
    assert all(set(CURVES) <= set(row) for row in history)
    h = {k.decode(): v.decode() for k, v in r.hgetall(Keys("wb").learner).items()}
    assert history[-1]["train/loss"] == pytest.approx(float(h["loss"]), rel=1e-5)
    config = wandb_log.config(log_file)
    assert config["batch_groups"] == 2 and config["report_to"] == ["wandb"]


def test_report_to_is_checked_when_the_config_is_read(tmp_path):
    assert targets("none") == [] and targets("all") == ["tensorboard", "wandb"]
    assert targets(["tensorboard", "none"]) == ["tensorboard"]
    path = tmp_path / "c.toml"
    path.write_text('[learner]\nmodel = "m"\nreport_to = "mlflow"\n')
    with pytest.raises(ValueError, match="report_to: unknown 'mlflow'"):
        load_learner_config(path)
    path.write_text('[learner]\nmodel = "m"\nreport_to = ["tensorboard", "wandb"]\n')
    cfg = load_learner_config(path)
    assert msgspec.structs.asdict(cfg)["report_to"] == ["tensorboard", "wandb"]
