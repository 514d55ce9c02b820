"""Atomic checkpoints of the learner: weights, optimizer, RNG states and progress.

Layout (``<output_dir>/checkpoints/``)::

    step-00000012/
        weights.pt     trainable parameters by name (the LoRA adapter only, under LoRA)
        optimizer.pt   AdamW state
        rng.pt         torch (CPU and CUDA), python ``random`` and numpy RNG states
        state.json     LearnerState: step, policy version, counters, last consumed stream ID
        sharded/       instead of weights.pt and optimizer.pt, under ``sharding = "fsdp"``:
                       every rank's shards of both (torch.distributed.checkpoint, see
                       ``streamrl.learner.sharded``)

A checkpoint is written to ``.tmp-step-…`` beside it, every file fsynced, then renamed into
place and the directory fsynced: a directory named ``step-*`` is always complete. The newest
one wins; older ones beyond ``keep`` are deleted.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
from torch import nn

from streamrl.learner import sharded
from streamrl.learner._failpoints import failpoint
from streamrl.learner.sharded import SHARDED_DIR

_PREFIX = "step-"
_TMP_PREFIX = ".tmp-"


class Counters(msgspec.Struct, kw_only=True):
    """What the learner did with the groups it read. Consumed = applied + every dropped_*."""

    groups_consumed: int = 0
    groups_applied: int = 0
    dropped_stale: int = 0
    dropped_zero_variance: int = 0
    dropped_no_tokens: int = 0
    dropped_invalid: int = 0
    # of dropped_zero_variance (learner.outcomes): every sample at the top reward (solved),
    # or all alike below it (no signal); solved + no_signal = zero_variance
    groups_solved: int = 0
    groups_no_signal: int = 0
    samples_consumed: int = 0
    tokens_trained: int = 0
    # off-policy evidence: applied groups by how many versions behind the learner they were
    # ("0", "1", ...), and completion tokens whose importance weight π_old/μ fell outside
    # [importance_sampling_min, importance_sampling_max] (truncated or masked) of those with μ
    staleness: dict[str, int] = msgspec.field(default_factory=dict)
    is_tokens: int = 0
    is_clipped: int = 0

    def add(self, other: Counters) -> None:
        for f in self.__struct_fields__:
            mine, theirs = getattr(self, f), getattr(other, f)
            if isinstance(mine, dict):
                for k, v in theirs.items():
                    mine[k] = mine.get(k, 0) + v
            else:
                setattr(self, f, mine + theirs)

    def drop_fractions(self) -> dict[str, float]:
        """Of the groups consumed, the fraction dropped for each reason: the rollouts the
        learner paid for and could not use."""
        n = max(1, self.groups_consumed)
        reasons = ("stale", "zero_variance", "no_tokens", "invalid")
        return {r: round(getattr(self, f"dropped_{r}") / n, 4) for r in reasons}

    def fields(self) -> dict[str, str | int | float]:
        """As the learner's progress hash holds them (``streamrl status``, the metrics)."""
        out: dict[str, str | int | float] = {
            k: v for k, v in msgspec.structs.asdict(self).items() if not isinstance(v, dict)
        }
        out["applied_staleness"] = msgspec.json.encode(self.staleness).decode()
        out["is_clipped_fraction"] = round(self.is_clipped / max(1, self.is_tokens), 4)
        for reason, frac in self.drop_fractions().items():
            out[f"dropped_fraction_{reason}"] = frac
        return out


class LearnerState(msgspec.Struct, kw_only=True):
    """Everything besides tensors that a restart needs. ``last_id``: the newest ``groups``
    entry whose effect (applied or dropped) is in the weights; entries up to it are acked.
    ``last_ids``: the same per shard, for a sharded run."""

    step: int = 0
    policy_version: int = 0
    last_id: str = "0-0"
    # a sharded run: per shard (its index as a string), the newest covered entry
    last_ids: dict[str, str] = msgspec.field(default_factory=dict)
    counters: Counters = msgspec.field(default_factory=Counters)
    reward_mean: float = 0.0
    loss: float = 0.0
    checkpoint_step: int = 0
    checkpoint_time: float = 0.0
    entropy_coef: float | None = None  # the adaptive coefficient (None: config's entropy_coef)
    # why this learner stopped itself: the one-line verdict of stop_when_solved ("" when it
    # did not); a learner restarted from the checkpoint starts without one
    verdict: str = ""

    def fields(self, sharded: bool) -> dict[str, str | int | float]:
        """Progress as the learner's hash holds it (the counters: ``Counters.fields``)."""
        out: dict[str, str | int | float] = {
            "step": self.step,
            "policy_version": self.policy_version,
            "last_id": self.last_id,
            "last_checkpoint_step": self.checkpoint_step,
            "last_checkpoint_time": self.checkpoint_time,
            "reward_mean": self.reward_mean,
            "loss": self.loss,
            "verdict": self.verdict,
        }
        if sharded:
            out["last_ids"] = msgspec.json.encode(self.last_ids).decode()
        return out


def _trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


class CheckpointFailed(RuntimeError):
    """A checkpoint could not be written (disk full, file too large): the learner stops,
    with nothing acked past the last complete checkpoint."""


def write_failure(e: BaseException, directory: Path) -> str:
    """Why a write under ``directory`` failed, in one line. torch.save and safetensors hide
    the OS error (``unexpected pos …``, ``I/O error``), so the free space and the process's
    file size limit are added: what an operator needs to see a full disk."""
    text = " ".join(str(e).split()) or type(e).__name__
    parts = [f"{type(e).__name__}: {text}"]
    with contextlib.suppress(OSError):
        parts.append(f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB free there")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        parts.append(f"file size limit {limit} bytes")
    return "; ".join(parts)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    directory: Path,
    state: LearnerState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    keep: int = 2,
    writer: Callable[[Path], None] | None = None,
) -> Path:
    """Write ``step-<step>`` atomically; ``writer``: how the weights and optimizer state are
    written into the directory it is given, when not as ``weights.pt`` and ``optimizer.pt``
    (sharded: every rank writes its shards)."""
    directory.mkdir(parents=True, exist_ok=True)
    name = f"{_PREFIX}{state.step:08d}"
    final = directory / name
    tmp = directory / f"{_TMP_PREFIX}{name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        if writer is None:
            torch.save(_trainable_state(model), tmp / "weights.pt")
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        else:
            writer(tmp / SHARDED_DIR)
            fsync_path(tmp / SHARDED_DIR)  # its files are fsynced by DCP's writer
        torch.save(_rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_bytes(msgspec.json.encode(state))
        for f in tmp.iterdir():
            fsync_path(f)
        fsync_path(tmp)
    except Exception as e:  # a full disk, whatever torch.save makes of it
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(directory)
        raise CheckpointFailed(
            f"checkpoint of step {state.step} not written ({write_failure(e, directory)}); "
            f"the last complete checkpoint is {last.name if last else 'none'} in {directory}, "
            "a restart resumes from it"
        ) from e
    failpoint("mid_checkpoint", state.step)
    old = None
    if final.exists():  # the same step written again: move the old one aside, never delete first
        old = directory / f"{_TMP_PREFIX}old-{name}-{os.getpid()}"
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_path(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for old in _checkpoints(directory)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if p.is_dir() and p.name.startswith(_PREFIX))


def clean_temporaries(directory: Path) -> None:
    """Half-written checkpoints of a process that died while writing."""
    if directory.is_dir():
        for p in directory.iterdir():
            if p.name.startswith(_TMP_PREFIX):
                shutil.rmtree(p, ignore_errors=True)


def latest_checkpoint(directory: Path) -> Path | None:
    found = _checkpoints(directory)
    return found[-1] if found else None


def read_state(path: Path) -> LearnerState:
    return msgspec.json.decode((path / "state.json").read_bytes(), type=LearnerState)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's trainable weights by name, as full tensors on CPU (either layout)."""
    if (path / SHARDED_DIR).is_dir():
        return sharded.read_weights(path / SHARDED_DIR)
    return torch.load(path / "weights.pt", map_location="cpu", weights_only=True)


def restore_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, is_sharded: bool = False
) -> LearnerState:
    """Load ``path`` into ``model`` and ``optimizer`` and set the RNG states; returns its
    progress. ``is_sharded``: an FSDP model, which every rank restores from ``sharded/``."""
    if is_sharded:
        sharded.load(path / SHARDED_DIR, model, optimizer)
        _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
        return read_state(path)
    if (path / SHARDED_DIR).is_dir():
        raise RuntimeError(
            f"checkpoint {path} was written by a sharded learner (sharding = 'fsdp'): restore "
            "it with the same setting, or start from an empty output_dir"
        )
    weights = torch.load(path / "weights.pt", map_location="cpu", weights_only=True)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    missing = params.keys() ^ weights.keys()
    if missing:
        raise RuntimeError(f"checkpoint {path} does not match the model: {sorted(missing)[:5]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n])
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    _set_rng_state(torch.load(path / "rng.pt", weights_only=False))
    return read_state(path)
