"""A KV cache that decodes in place. transformers' ``DynamicLayer`` concatenates each step's
keys and values onto the cache, copying every layer's whole cache at every step: a fifth of a
bfloat16 decode step of SmolLM2-135M at 64 rows on a CPU. Imported by the decode loop only
(it imports transformers)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


class RoomyLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys and values are views of buffers with room for the tokens
    still to come; past that room (or after something replaced its tensors, as
    ``reorder_cache`` does) it concatenates like its parent."""

    buffers: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, layer: DynamicLayer, room: int) -> RoomyLayer:
        new = cls()
        new.device, new.is_initialized = layer.device, True
        n = layer.keys.shape[-2]
        bufs = []
        for t in (layer.keys, layer.values):
            buf = t.new_empty((*t.shape[:-2], n + room, t.shape[-1]))
            buf[..., :n, :] = t
            bufs.append(buf)
        new.buffers = (bufs[0], bufs[1])
        new.keys, new.values = bufs[0][..., :n, :], bufs[1][..., :n, :]
        return new

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.buffers
        n, m = self.keys.shape[-2], key_states.shape[-2]
        if n + m > k.shape[-2] or self.keys.data_ptr() != k.data_ptr():
            return super().update(key_states, value_states, *args, **kwargs)
        k[..., n : n + m, :] = key_states
        v[..., n : n + m, :] = value_states
        self.keys, self.values = k[..., : n + m, :], v[..., : n + m, :]
        return self.keys, self.values


def roomy(cache: Any, steps: int) -> None:
    """Give every layer of a prefilled cache room for ``steps`` more positions. A cache of
    another kind (sliding windows, static, a model's own) is left as it is."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return
    cache.layers = [RoomyLayer.of(layer, steps) for layer in layers]
