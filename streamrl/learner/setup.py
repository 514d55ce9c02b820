"""What every learner process does before its first step, rank 0 and data-parallel followers
alike: process settings, then the model, the reference model, the optimizer and the
checkpoint to resume from.

Rank 0 chooses the checkpoint (the newest complete one) and tells the other ranks, so every
rank restores the same weights, optimizer moments and RNG state. The collectives below run in
the same order on every rank: the checkpoint's path, DDP's broadcast of rank 0's weights (or,
under FSDP, the sharded restore), the process ids and parameter counts.

Under ``sharding = "fsdp"`` the model is sharded before the optimizer is made (its parameters
become the shards), and the reference model (β ≠ 0, full fine-tuning) is sharded too.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import structlog
import torch
from torch import nn

from streamrl.learner.checkpoint import (
    LearnerState,
    clean_temporaries,
    latest_checkpoint,
    restore_checkpoint,
)
from streamrl.learner.config import LearnerConfig
from streamrl.learner.distributed import DataParallel, follow, park, world_size, wrap
from streamrl.learner.model import AdapterDisabled, load_model, load_reference, seed_everything
from streamrl.learner.sharded import shard
from streamrl.learner.train import make_optimizer

log = structlog.get_logger("streamrl.learner")


def start_process(
    cfg: LearnerConfig, run: str, stop: threading.Event
) -> tuple[LearnerConfig, DataParallel | None]:
    """Join the data-parallel job if there is one (its rank's device replaces ``device``),
    let SIGTERM/SIGINT set ``stop`` on rank 0, set torch's threads, the log context and the
    seeds. Returns the config this process trains with."""
    dp = DataParallel.init(cfg) if world_size() > 1 else None
    if dp is not None:
        cfg = msgspec.structs.replace(cfg, device=str(dp.device))
    if dp is None or dp.leader:
        _stop_on_signals(stop)  # other ranks die of SIGTERM: rank 0 stops them with a command
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    structlog.contextvars.bind_contextvars(
        run=run,
        role="learner",
        worker=f"{socket.gethostname()}-{os.getpid()}",
        **({"rank": dp.rank} if dp else {}),
    )
    seed_everything(cfg.seed)
    return cfg, dp


def _stop_on_signals(stop: threading.Event) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())


@dataclass
class Training:
    """What a rank trains with, restored from ``restored`` (None: a fresh start)."""

    model: nn.Module
    tokenizer: object
    optimizer: torch.optim.Optimizer
    ref_model: nn.Module | None
    state: LearnerState
    restored: Path | None
    # data parallel: the model wrapped in DDP, or the model itself when sharded by FSDP
    parallel: nn.Module | None = None
    # data parallel: every rank's pid and the parameter elements it holds
    ranks: list[tuple[int, int]] = field(default_factory=list)


def load_training(cfg: LearnerConfig, out: Path, dp: DataParallel | None) -> Training:
    """The model, its reference (only with ``beta`` != 0: the adapter switched off under
    LoRA, else a frozen copy), AdamW, and the checkpoint under ``out`` restored into them."""
    sharded = dp is not None and cfg.sharding == "fsdp"
    model, tokenizer, device = load_model(cfg, place=not sharded)
    if sharded:
        model = shard(model)  # its shards move to the rank's device
    ref_model = None
    if cfg.beta != 0.0:
        if cfg.lora_r > 0:
            ref_model = AdapterDisabled(model)
        else:
            ref_model = load_reference(cfg, torch.device("cpu") if sharded else device)
            ref_model = shard(ref_model) if sharded else ref_model
    optimizer = make_optimizer(model, cfg)
    path = _checkpoint_to_restore(out / "checkpoints", dp)
    state = restore_checkpoint(path, model, optimizer, sharded) if path else LearnerState()
    training = Training(model, tokenizer, optimizer, ref_model, state, path)
    if dp is not None:
        training.parallel = model if sharded else wrap(model, dp)
        training.ranks = dp.gather_ranks(model)
    return training


def _checkpoint_to_restore(ckpt_dir: Path, dp: DataParallel | None) -> Path | None:
    """Rank 0: the newest complete checkpoint (half-written ones are removed first), sent to
    the other ranks; they restore what it sends."""
    if dp is not None and not dp.leader:
        sent = dp.broadcast_text(None)
        return Path(sent) if sent else None
    clean_temporaries(ckpt_dir)
    path = latest_checkpoint(ckpt_dir)
    if dp is not None:
        dp.broadcast_text(str(path) if path else "")
    return path


def run_follower(dp: DataParallel, cfg: LearnerConfig, run: str) -> LearnerState:
    """Ranks > 0: the same model, optimizer and checkpoint as rank 0, then its steps."""
    t = load_training(cfg, cfg.out_dir(run), dp)
    restored = str(t.restored) if t.restored else None
    log.info("rank started", rank=dp.rank, world=dp.world, restored=restored)
    assert t.parallel is not None  # load_training wraps the model on every rank
    pad = t.tokenizer.pad_token_id
    t.state.step += follow(dp, t.parallel, t.optimizer, cfg, pad, t.ref_model)
    log.info("rank stopped", rank=dp.rank, step=t.state.step)
    park(t, dp)  # torn down by exit_rank, never by a destructor here
    return t.state
