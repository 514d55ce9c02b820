"""Training curves where researchers look: the learner's ``report_to`` (TRL's name and
meaning): ``"tensorboard"`` writes event files under ``<output_dir>/runs``, ``"wandb"`` logs a
Weights & Biases run (offline unless ``WANDB_MODE`` says otherwise: it needs no network, and
``wandb sync <output_dir>/wandb/offline-run-*`` uploads it later), ``"none"`` (the default)
writes nothing. A list reports to several, ``"all"`` to both.

Every optimizer step logs the same scalars, under TRL's ``train/`` names where TRL has one.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import structlog

_REPORTERS = ("tensorboard", "wandb")
log = structlog.get_logger("streamrl.learner")


class ReportUnavailable(RuntimeError):
    """A ``report_to`` target whose package is not installed."""


def targets(report_to: str | list[str]) -> list[str]:
    """``report_to`` as a list of reporters; ``ValueError`` names an unknown one."""
    names = [report_to] if isinstance(report_to, str) else list(report_to)
    if "all" in names:
        return list(_REPORTERS)
    out = [n for n in names if n != "none"]
    unknown = [n for n in out if n not in _REPORTERS]
    if unknown:
        allowed = ", ".join(("none", "all", *_REPORTERS))
        raise ValueError(f"report_to: unknown {', '.join(map(repr, unknown))} (one of {allowed})")
    return list(dict.fromkeys(out))


def check_available(report_to: str | list[str]) -> None:
    """Raise ``ReportUnavailable`` now, before a model is loaded, for a missing package."""
    import importlib.util

    packages = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for name in targets(report_to):
        if importlib.util.find_spec(packages[name]) is None:
            raise ReportUnavailable(
                f"report_to = {name!r} needs the {packages[name]} package: "
                f"pip install 'streamrl[{name}]'"
            )


def step_scalars(stats: Any, staleness: Mapping[str, int], since_last_s: float) -> dict:
    """The scalars of one step: ``stats`` is a ``train.StepStats``, ``staleness`` the step's
    applied groups by how many versions behind they were."""
    groups = sum(staleness.values())
    behind = sum(int(k) * n for k, n in staleness.items())
    return {
        "train/loss": stats.loss,
        "train/reward": stats.reward_mean,
        "train/reward_std": stats.reward_std,
        "train/entropy": stats.entropy,
        "train/grad_norm": stats.grad_norm,
        "train/learning_rate": stats.lr,
        "train/clip_ratio/low_mean": stats.clip_low,
        "train/clip_ratio/high_mean": stats.clip_high,
        "train/clip_ratio/region_mean": stats.clip_low + stats.clip_high,
        "train/importance_weight/mean": stats.is_weight_mean,
        "train/importance_weight/min": stats.is_weight_min,
        "train/importance_weight/max": stats.is_weight_max,
        "train/importance_weight/clipped_fraction": stats.is_clipped / max(1, stats.is_tokens),
        "train/staleness/mean": behind / groups if groups else 0.0,
        "train/staleness/max": max((int(k) for k in staleness), default=0),
        "train/num_tokens": stats.tokens,
        "train/tokens_per_second": stats.tokens / stats.seconds if stats.seconds else 0.0,
        "train/step_seconds": stats.seconds,
        # wall time between two steps: the pipeline's pace, waiting for groups included
        "train/seconds_since_last_step": since_last_s,
        # sampler vs learner on the rows the current weights sampled; absent when none was
        **{f"train/{k}": v for k, v in stats.mismatch.means().items()},
    }


class _Reporter(Protocol):
    def log(self, step: int, scalars: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


class _TensorBoard:
    """Event files through torch's ``SummaryWriter`` (needs the ``tensorboard`` package)."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ReportUnavailable(
                "report_to = 'tensorboard' needs the tensorboard package: "
                "pip install 'streamrl[tensorboard]'"
            ) from e
        self.dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandB:
    """A wandb run in ``<output_dir>/wandb``, resumed across learner restarts (same id)."""

    def __init__(self, out: Path, run: str, config: Mapping[str, Any]):
        try:
            import wandb
        except ImportError as e:
            raise ReportUnavailable(
                "report_to = 'wandb' needs the wandb package: pip install 'streamrl[wandb]'"
            ) from e
        out.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "streamrl"),
            name=run,
            id=_stable_id(out, run),
            resume="allow",
            dir=str(out),
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            config=dict(config),
            settings=wandb.Settings(silent=True, console="off"),
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


def _stable_id(out: Path, run: str) -> str:
    """One wandb run id per output dir, kept in a file: a restarted learner continues it."""
    import re
    import uuid

    path = out / "wandb-run-id"
    if path.exists():
        return path.read_text().strip()
    rid = f"{re.sub(r'[^A-Za-z0-9_-]', '-', run)[:32]}-{uuid.uuid4().hex[:8]}"
    path.write_text(rid)
    return rid


class Reporters:
    """Every configured reporter; a reporter that fails while logging is closed and dropped
    with one error line (curves are worth less than the training run)."""

    def __init__(self, reporters: list[_Reporter]):
        self.reporters = reporters

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        for rep in list(self.reporters):
            try:
                rep.log(step, scalars)
            except Exception as e:
                log.error("report_to failed; not reporting to it again", to=type(rep).__name__,
                          error=repr(e))  # fmt: skip
                self.reporters.remove(rep)

    def close(self) -> None:
        for rep in self.reporters:
            try:
                rep.close()
            except Exception as e:
                log.warning("report_to close failed", to=type(rep).__name__, error=repr(e))
        self.reporters = []


def make_reporters(
    report_to: str | list[str], out: Path, run: str, config: Mapping[str, Any]
) -> Reporters:
    """The reporters ``report_to`` names, writing under the learner's output dir ``out``."""
    reps: list[_Reporter] = []
    for name in targets(report_to):
        if name == "tensorboard":
            reps.append(_TensorBoard(out / "runs"))
        elif name == "wandb":
            reps.append(_WandB(out, run, config))
    return Reporters(reps)
