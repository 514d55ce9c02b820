"""Sharded data parallel, ``[learner] sharding = "fsdp"``: PyTorch's FSDP2 (``fully_shard``)
under the same torchrun launch and the same one-reader design as DDP (``distributed``).

What is sharded. Every transformer block (the classes the model lists in
``_no_split_modules``, e.g. ``LlamaDecoderLayer``) is one FSDP unit, and the root (embeddings,
final norm, ``lm_head``) another: each rank keeps 1/N of every parameter, of its gradient and
of its AdamW moments. A block's weights are all-gathered just before its forward (and again
for its backward) and freed after; gradients are reduce-scattered after each micro-batch's
backward, averaged over ranks as DDP does, so the training step is DDP's
(``distributed.train_step``) with the same per-rank scaling. Params, grads and AdamW state per
rank: about 16/N bytes per fp32 parameter instead of 16.

Checkpoints (``checkpoint.save_checkpoint`` with a ``writer``). ``torch.distributed.checkpoint``
(DCP): every rank writes its own shards of the trainable weights and of the AdamW state into
``step-…/sharded/`` (``__<rank>_0.distcp``, plus rank 0's ``.metadata``); rank 0 writes the rest
of the checkpoint as for one process, then renames the directory. ``dcp.save`` returns on rank 0
only after every rank's files are written, so a ``step-*`` directory is still always complete.
DCP reshards on load: a restart may use another number of ranks. ``read_weights`` reads one
into full tensors without a process group (tests, export).

Publishing. Rollout workers need whole weights: ``full_state_dict`` all-gathers them into
rank 0's CPU memory (every rank takes part, the others get nothing) and rank 0 writes the same
``model.safetensors`` (or LoRA adapter) as an unsharded learner.

Loading. Each rank loads the whole model into CPU memory, shards it, and only its shards move
to its device (``fully_shard`` moves them): GPU memory holds 1/N of the model from the start,
host memory briefly the whole of it per rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

SHARDED_DIR = "sharded"  # inside a checkpoint directory
_OPTIONS = StateDictOptions(ignore_frozen_params=True)  # under LoRA: the adapter and its moments


def _block_classes(model: nn.Module) -> set[str]:
    """The transformer block classes transformers names in ``_no_split_modules`` (under peft,
    the wrapped model's)."""
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or [])
    return names


def shard(model: nn.Module) -> nn.Module:
    """FSDP2 over ``model`` in place: one unit per transformer block, then the root."""
    blocks = _block_classes(model)
    if not blocks:
        raise ValueError(
            f"sharding = 'fsdp': {type(model).__name__} names no transformer block class "
            "(_no_split_modules); there is nothing to shard by"
        )
    for m in list(model.modules()):
        if type(m).__name__ in blocks:
            fully_shard(m)
    fully_shard(model)
    return model


def local_numel(model: nn.Module) -> int:
    """Parameter elements this rank holds: its shards under FSDP, every parameter otherwise."""
    return sum(
        p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters()
    )


def save(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: write this rank's shards of the trainable weights and AdamW state."""
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank: read this rank's shards of a checkpoint written by ``save`` (any number of
    ranks) into ``model`` and ``optimizer``."""
    if not (path / ".metadata").is_file():
        raise RuntimeError(
            f"checkpoint {path.parent} was not written by a sharded learner (no {path.name}/); "
            "restore it with sharding = 'none', or start from an empty output_dir"
        )
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)  # AdamW state initialised
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)  # raises if a trainable weight is not in it
    set_state_dict(  # not strict: under LoRA the frozen base is not in the checkpoint
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every rank: all-gather the whole weights; rank 0 gets them on CPU, the others ``{}``."""
    return get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """The full trainable weights of a sharded checkpoint directory (``step-…/sharded``), read
    in this process alone (no process group needed)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "model."
    weights = {
        key[len(prefix) :]: torch.empty(m.size, dtype=m.properties.dtype)
        for key, m in meta.items()
        if key.startswith(prefix) and isinstance(m, TensorStorageMetadata)
    }
    dcp.load({"model": weights}, checkpoint_id=path, no_dist=True)
    return weights
