"""The data-parallel learner: ``torchrun --nproc-per-node N -m streamrl.cli learn …`` (or
``streamrl learn --nproc N``, which runs that command for you).

Who reads the stream. **Rank 0 alone** reads ``groups``, decides what to train on (stale,
zero-variance, invalid: dropped and counted), checkpoints and XACKs, and publishes weights,
exactly as the single-process learner does; the other ranks never talk to Redis. At each
optimizer step rank 0 broadcasts the step's groups (their msgpack, a few KB) to every rank;
every rank lays out the same batch and trains on its contiguous share of the batch's
sequences; DDP all-reduces the gradients, so every rank applies the same update. With
``[learner] sharding = "fsdp"`` each rank holds 1/N of the model instead of a replica
(FSDP2, see ``streamrl.learner.sharded``); the step is the same, and rank 0 also tells the
other ranks when to write their shards of a checkpoint and when to all-gather the weights for
a policy version (both are collectives).

Why not one reader per rank: exactly-once rests on one consumer whose pending list and one
``last_id`` in the checkpoint say what the weights contain. With a reader per rank the
checkpoint would need every rank's position, a step would wait for the slowest rank to fill
its share, and ranks would disagree on staleness drops. Decoding groups on one process costs
milliseconds per step; the forward/backward it feeds costs seconds.

Equivalence. The loss of a chunk is normalised by the *whole* batch (``num_sequences``,
``num_tokens``), so the chunk losses of all ranks sum to the single-process batch loss; DDP
averages gradients over ranks, so each rank scales its loss by the world size. The update is
the single-process update up to float summation order (``bnpo`` averages over chunks, so
there, as in TRL, the result depends on how the batch is cut).

Failures. Rank 0 broadcasts a heartbeat on every pass of its read loop, so a dead rank is
noticed within one ``block_ms`` even while no group arrives, and every collective has a
timeout (``dist_timeout_s``): no rank waits forever. A failed collective raises, the rank exits
non-zero and torchrun stops the others. Nothing is lost: only a checkpoint of rank 0 (written
between steps, when every rank holds the same weights) leads to an XACK, and a restart loads
that checkpoint on every rank and re-reads rank 0's pending entries. ``output_dir`` must be
one directory every rank can read (one machine, or a shared filesystem).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import NoReturn

import msgspec
import structlog
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from streamrl import schema
from streamrl.learner.batch import Batch, make_batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.mismatch import Mismatch
from streamrl.learner.sharded import full_state_dict, local_numel
from streamrl.learner.sharded import save as save_shards
from streamrl.learner.train import BatchLoss, StepStats, add_chunk, apply_update, chunk_loss


class _StepPayload(msgspec.Struct, array_like=True):
    """What rank 0 sends for a step: its groups, and the settings that vary by step (the
    adaptive entropy coefficient), so that every rank computes the same loss."""

    entropy_coef: float
    groups: list[schema.Group]
    weights_version: int | None = None  # marks the on-policy rows (learner.mismatch)


log = structlog.get_logger("streamrl.learner")
_STEP = msgspec.msgpack.Decoder(_StepPayload)
_ENCODER = msgspec.msgpack.Encoder()


class _Command(IntEnum):
    HEARTBEAT = 0
    STEP = 1
    STOP = 2
    CHECKPOINT = 3  # sharded: write your shards into the directory in the payload
    GATHER = 4  # sharded: all-gather the weights to rank 0 (a policy version)


def world_size() -> int:
    """Processes in the job: torchrun's ``WORLD_SIZE``, 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass
class DataParallel:
    """This process's place in the job, and the collectives the learner needs."""

    rank: int
    world: int
    device: torch.device

    @classmethod
    def init(cls, cfg: LearnerConfig) -> DataParallel:
        """Join the process group torchrun set up: nccl on GPU, gloo on CPU."""
        local = int(os.environ.get("LOCAL_RANK", "0"))
        want_cuda = cfg.device.startswith("cuda") or (
            cfg.device == "auto" and torch.cuda.is_available()
        )
        if want_cuda:
            device = torch.device("cuda", local)
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        if not dist.is_initialized():
            dist.init_process_group(
                "nccl" if want_cuda else "gloo",
                timeout=datetime.timedelta(seconds=cfg.dist_timeout_s),
            )
        return cls(dist.get_rank(), dist.get_world_size(), device)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    # -- rank 0 -> every rank: a command with an optional payload
    def send(self, command: _Command, step: int = 0, payload: bytes = b"") -> None:
        header = torch.tensor([int(command), step, len(payload)], dtype=torch.long)
        dist.broadcast(header.to(self.device), src=0)
        if payload:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            dist.broadcast(data.to(self.device), src=0)

    def receive(self) -> tuple[_Command, int, bytes]:
        header = torch.empty(3, dtype=torch.long, device=self.device)
        dist.broadcast(header, src=0)
        command, step, size = (int(x) for x in header.cpu())
        payload = b""
        if size:
            data = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.broadcast(data, src=0)
            payload = data.cpu().numpy().tobytes()
        return _Command(command), step, payload

    def broadcast_text(self, text: str | None) -> str:
        """Rank 0's string on every rank (which checkpoint to restore)."""
        box = [text]
        dist.broadcast_object_list(box, src=0)  # between our own ranks only, never from Redis
        return str(box[0])

    def gather_ranks(self, model: nn.Module) -> list[tuple[int, int]]:
        """Every rank's (pid, parameter elements it holds): the whole model under DDP, its
        shards under FSDP."""
        mine = torch.tensor([os.getpid(), local_numel(model)], dtype=torch.long, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(out, mine)
        return [(int(t[0]), int(t[1])) for t in out]

    def sum(self, values: list[float], op: dist.ReduceOp = dist.ReduceOp.SUM) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=op)
        return t.cpu().tolist()


def wrap(model: nn.Module, dp: DataParallel) -> DistributedDataParallel:
    """DDP over the model; its constructor broadcasts rank 0's weights to every rank."""
    ids = [dp.device.index] if dp.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


_NO_OP = contextlib.nullcontext()


def rank_chunks(batch: Batch, micro: int, rank: int, world: int) -> list[slice]:
    """This rank's row slices: a contiguous share of the batch cut into micro-batches, padded
    with empty slices so that every rank runs as many backward passes (DDP syncs on the last)."""
    n = batch.num_sequences
    per = -(-n // world)  # rows per rank, the last rank may get fewer (or none)
    lo, hi = min(n, rank * per), min(n, (rank + 1) * per)
    size = micro or per
    count = max(1, -(-per // size))
    out = [slice(i, min(hi, i + size)) for i in range(lo, hi, size)]
    return out + [slice(lo, lo)] * (count - len(out))


def num_chunks(batch: Batch, micro: int, world: int) -> int:
    """Non-empty chunks over all ranks: ``bnpo``'s divisor."""
    return sum(
        sum(1 for s in rank_chunks(batch, micro, r, world) if s.stop > s.start)
        for r in range(world)
    )


def _rank_train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    cfg: LearnerConfig,
    step: int,
    dp: DataParallel,
    ref_model: nn.Module | None = None,
) -> StepStats:
    """``train.train_step`` over ranks: this rank's share of the batch, gradients averaged
    over ranks (DDP: all-reduced once, after the last micro-batch; FSDP: reduce-scattered to
    each rank's shards after every micro-batch), then the same clip and AdamW update on every
    rank (on its shards under FSDP)."""
    model.train()
    optimizer.zero_grad(set_to_none=True)
    chunks = rank_chunks(batch, cfg.micro_batch_size, dp.rank, dp.world)
    total_chunks = num_chunks(batch, cfg.micro_batch_size, dp.world)
    started = time.perf_counter()
    mine = BatchLoss(0.0, 0.0)
    for i, rows in enumerate(chunks):
        empty = rows.stop <= rows.start
        last = i == len(chunks) - 1
        ddp = isinstance(model, DistributedDataParallel)
        sync = model.no_sync() if ddp and not last else _NO_OP  # DDP: one all-reduce
        with sync:
            # a rank without rows still joins the all-reduce: one row, weight 0
            part = chunk_loss(model, batch, slice(0, 1) if empty else rows, cfg, ref_model,
                              total_chunks)  # fmt: skip
            (part.value * (0.0 if empty else dp.world)).backward()
        if not empty:
            mine.loss += float(part.value.detach())
            mine.entropy += part.entropy
            add_chunk(mine, part)
    m = mine
    mm = m.mismatch
    sums = dp.sum([m.loss, m.entropy, m.is_tokens, m.is_clipped, m.is_weight_sum,
                   m.clipped_low, m.clipped_high, mm.tokens, mm.abs_sum, mm.k3_sum])  # fmt: skip
    lo = dp.sum([m.is_weight_min], dist.ReduceOp.MIN)[0]
    hi = dp.sum([m.is_weight_max], dist.ReduceOp.MAX)[0]
    measured = BatchLoss(
        sums[0], sums[1] / max(1, batch.num_tokens), int(sums[2]), int(sums[3]), sums[4],
        lo, hi, int(sums[5]), int(sums[6]), Mismatch(int(sums[7]), sums[8], sums[9]),
    )  # fmt: skip
    return apply_update(optimizer, batch, cfg, step, measured, started)


class Trainer:
    """Rank 0's side of a step: send the groups, then train on its own share; under FSDP,
    also of a checkpoint and of a policy version's weights."""

    def __init__(self, dp: DataParallel, model: nn.Module, pad_token_id: int):
        self.dp, self.model, self.pad = dp, model, pad_token_id

    @property
    def sharded(self) -> bool:
        return not isinstance(self.model, DistributedDataParallel)

    def shard_writer(self, optimizer: torch.optim.Optimizer) -> Callable[[Path], None] | None:
        """Under FSDP, ``save_checkpoint``'s writer: every rank writes its shards into the
        directory it is given. None under DDP (rank 0 writes the whole model)."""
        if not self.sharded:
            return None

        def write(path: Path) -> None:
            self.dp.send(_Command.CHECKPOINT, 0, str(path).encode())
            save_shards(path, self.model, optimizer)

        return write

    def full_weights(self) -> dict[str, torch.Tensor] | None:
        """Under FSDP, the whole weights on rank 0, all-gathered from every rank's shards (for
        a policy version). None under DDP: rank 0's replica is whole."""
        if not self.sharded:
            return None
        self.dp.send(_Command.GATHER)
        return full_state_dict(self.model)

    def step(
        self,
        groups: list[schema.Group],
        optimizer: torch.optim.Optimizer,
        cfg: LearnerConfig,
        step: int,
        ref_model: nn.Module | None,
        weights_version: int | None = None,
    ) -> StepStats:
        sent = _StepPayload(cfg.entropy_coef, groups, weights_version)
        self.dp.send(_Command.STEP, step, _ENCODER.encode(sent))
        batch = make_batch(groups, self.pad, cfg.scale_rewards, weights_version)
        return _rank_train_step(self.model, optimizer, batch, cfg, step, self.dp, ref_model)

    def heartbeat(self) -> None:
        self.dp.send(_Command.HEARTBEAT)

    def stop(self) -> None:
        self.dp.send(_Command.STOP)


def follow(
    dp: DataParallel,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: LearnerConfig,
    pad_token_id: int,
    ref_model: nn.Module | None,
) -> int:
    """The loop of ranks > 0: train on what rank 0 sends until it says stop. Returns the
    number of steps taken."""
    steps = 0
    while True:
        command, step, payload = dp.receive()
        if command == _Command.STOP:
            return steps
        if command == _Command.STEP:
            sent = _STEP.decode(payload)
            step_cfg = msgspec.structs.replace(cfg, entropy_coef=sent.entropy_coef)
            batch = make_batch(
                sent.groups, pad_token_id, step_cfg.scale_rewards, sent.weights_version
            )
            _rank_train_step(model, optimizer, batch, step_cfg, step, dp, ref_model)
            steps += 1
        elif command == _Command.GATHER:
            full_state_dict(model)  # rank 0 keeps the result
        elif command == _Command.CHECKPOINT:
            try:
                save_shards(Path(payload.decode()), model, optimizer)
            except Exception as e:  # a full disk: rank 0 fails the checkpoint too, and stops us
                log.error("checkpoint shards not written", error=str(e))


def rank_fields(ranks: list[tuple[int, int]]) -> dict[str, str | int]:
    """The ranks in the learner's progress hash (``streamrl status``): their number, pids and
    the parameter elements each holds (1/N of the model each under FSDP). Empty: one process."""
    if not ranks:
        return {}
    return {
        "ranks": len(ranks),
        "rank_pids": ",".join(str(pid) for pid, _ in ranks),
        "rank_params": ",".join(str(n) for _, n in ranks),
    }


_PARKED: list[object] = []


def park(training: object, dp: DataParallel | None) -> None:
    """Under torchrun (``dp`` set), keep a rank's model (and with it DDP's reducer and the
    process group) alive until ``exit_rank``. Gloo's destructor joins its worker threads
    while holding the GIL, and a worker thread still releasing a finished broadcast's tensors
    needs the GIL: ranks hung for good in ``~ProcessGroupGloo``, from the reducer's dealloc
    when the learner returned (the CI's kill test timed out on it; here, 2 runs of it)."""
    if dp is not None:
        _PARKED.append(training)


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank without tearing down what ``park`` kept (see there). Everything
    that matters (checkpoint, XACK, logs) is done by now."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def launch(nproc: int, args: list[str]) -> int:
    """``streamrl learn --nproc N``: run the learner under torchrun on this machine."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc}", "-m", "streamrl.cli.learn", *args,
    ]  # fmt: skip
    return subprocess.call(cmd)
