"""Loading the model the learner trains, its tokenizer and (β > 0) its reference model."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from streamrl.learner.config import LearnerConfig
from streamrl.models.local import require_model_dir


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed)


def load_model(cfg: LearnerConfig, place: bool = True) -> tuple[nn.Module, Any, torch.device]:
    """The model to train (a peft model when ``lora_r > 0``), its tokenizer, and the device;
    ``place``: move the model there (False: it stays on CPU, for FSDP to move its shards)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = _resolve_device(cfg.device)
    dtype = getattr(torch, cfg.dtype)
    require_model_dir(cfg.model, "learner.model")
    model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model)
    if cfg.lora_r > 0:
        from peft import LoraConfig, get_peft_model

        seed_everything(cfg.seed)  # the adapter's initialisation
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=cfg.lora_target_modules,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    if place:
        model.to(device)
    model.train()
    return model, tokenizer, device


def load_reference(cfg: LearnerConfig, device: torch.device) -> nn.Module:
    """A frozen copy of the initial weights (full fine-tuning with β > 0)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=getattr(torch, cfg.dtype))
    ref.to(device).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


class AdapterDisabled(nn.Module):
    """Under LoRA the reference model is the base model: the same module, adapters off."""

    def __init__(self, peft_model: nn.Module):
        super().__init__()
        self._peft = [peft_model]  # not a submodule: no parameters of its own

    def forward(self, **kwargs: Any) -> Any:
        with self._peft[0].disable_adapter():
            return self._peft[0](**kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self._peft[0].parameters(recurse)
