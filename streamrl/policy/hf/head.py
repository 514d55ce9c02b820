"""The output head of a float32 CPU sampler through oneDNN, its weight packed once per policy
version. The head is a fifth of SmolLM2-135M's weights (49,152 x 576) and ran at a third of
the speed of the layers' matmuls: ``F.linear`` of 64 rows reached 30-44 GFLOP/s on a 2-core
AMD EPYC (Zen 3), oneDNN on the packed weight 45-68 (two runs), and twice as fast at 8 or 32
rows; on a layer's shape they are level, so only the head is packed
(``python bench/head_matmul.py``, ``bench/results/head_matmul_amd_zen3.json``). Used by the
decode loop only; the learner's head is untouched."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class PackedHead:
    """Swaps a model's output ``Linear`` forward for oneDNN's on a packed copy of its weight
    while the decode loop runs. The copy is remade when the weight changes: a new policy
    version loaded in place bumps the tensor's version counter, a replaced one its address."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._weight: Any = None
        self._bias: Any = None

    @staticmethod
    def fits(model: Any) -> torch.nn.Linear | None:
        """The head, when it is a plain float32 ``Linear`` on the CPU and oneDNN is built in
        (peft's wrapped heads, other dtypes and devices keep their own forward)."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if type(head) is not torch.nn.Linear or not torch.backends.mkldnn.is_available():
            return None
        w = head.weight
        return head if w.dtype == torch.float32 and w.device.type == "cpu" else None

    @contextlib.contextmanager
    def on(self, model: Any) -> Iterator[None]:
        head = self.fits(model)
        if head is None:
            yield
            return
        head.forward = lambda x: self._forward(head, x)  # the instance's, over the class's
        try:
            yield
        finally:
            del head.forward

    def _forward(self, head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        w = head.weight
        key = (w.data_ptr(), w._version)
        if key != self._key:
            self._weight = w.detach().to_mkldnn()
            bias = head.bias if head.bias is not None else w.new_zeros(w.size(0))
            self._bias = bias.detach().to_mkldnn()
            self._key = key
        flat = x.reshape(-1, x.size(-1)).contiguous()
        out = torch._C._nn.mkldnn_linear(flat.to_mkldnn(), self._weight, self._bias)
        return out.to_dense().view(*x.shape[:-1], w.size(0))
