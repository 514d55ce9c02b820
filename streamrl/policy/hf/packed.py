"""The decode loop's linear layers through oneDNN on weights packed once per policy version
(CPU, float32, or bfloat16 where oneDNN supports it). transformers runs a ``Linear`` through
``F.linear`` (MKL's sgemm). On a 2-core AMD EPYC Zen 4 at 64 rows that reached 97-150
GFLOP/s on SmolLM2-135M's layer shapes and 65-98 on its output head (49,152 x 576); oneDNN on
a weight reordered to its own blocked layout (``_reorder_linear_weight``, what inductor's CPU
weight prepacking uses) reached 155-194 and 165-187, and was faster at 8 and 2,880 rows too
(``python bench/packed_matmul.py``, ``bench/results/packed_matmul_zen4_2026-11-27.json``). A
float32 decode step of 64 rows went from 241-305 ms to 180-223. Below ``MIN_WEIGHT``
elements the call's own cost outweighs the gain (a 64 x 64 weight at 64 rows: 22 against
18 us), so small layers, such as all of the tiny test model's, keep ``F.linear``. The packed
copies cost the layers' weights' memory again; the learner's model is untouched."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

MIN_WEIGHT = 65_536  # elements: 256 x 256 was the break-even at 64 rows
ROWS_HINT = 64  # the row count oneDNN picks its layout for; any count runs


class PackedLinears:
    """Swaps the forward of every large plain ``Linear`` of a model for oneDNN's on a packed
    copy of its weight while the decode loop runs. A copy is remade when its weight changes:
    a new policy version loaded in place bumps the tensor's version counter, a replaced one
    its address."""

    def __init__(self, min_weight: int = MIN_WEIGHT) -> None:
        self.min_weight = min_weight
        # layer -> (its weight's address and version when packed, the packed weight)
        self._packed: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[tuple[int, int], Any]]
        self._packed = weakref.WeakKeyDictionary()

    def fits(self, model: Any) -> list[torch.nn.Linear]:
        """The layers packed: plain ``Linear`` (peft's wrapped ones keep their forward) on the
        CPU, float32 (bfloat16 where oneDNN has it), at least ``min_weight`` elements."""
        if not torch.backends.mkldnn.is_available():
            return []
        dtypes = {torch.float32}
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            dtypes.add(torch.bfloat16)
        return [
            m
            for m in model.modules()
            if type(m) is torch.nn.Linear
            and m.weight.device.type == "cpu"
            and m.weight.dtype in dtypes
            and m.weight.numel() >= self.min_weight
        ]

    @contextlib.contextmanager
    def on(self, model: Any) -> Iterator[None]:
        layers = self.fits(model)
        for layer in layers:  # the instance's forward, over the class's
            layer.forward = lambda x, layer=layer: self._forward(layer, x)
        try:
            yield
        finally:
            for layer in layers:
                del layer.forward

    def _forward(self, layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w = layer.weight
        key = (w.data_ptr(), w._version)
        packed = self._packed.get(layer)
        if packed is None or packed[0] != key:
            packed = (key, torch.ops.mkldnn._reorder_linear_weight(w.detach(), ROWS_HINT))
            self._packed[layer] = packed
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), packed[1], layer.bias, "none", [], ""
        )
