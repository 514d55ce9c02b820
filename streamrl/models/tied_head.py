"""An explicit output head in checkpoints of models that tie it to the input embedding.

``save_pretrained`` writes a tied head once, as ``model.embed_tokens.weight``. vLLM's CPU
backend computes logits from a copy of that weight packed at start-up, and its in-place
``reload_weights`` re-packs only the layers it loads weights into: a new version's embedding
then reaches the input but never the head (``bench/vllm_tied_head.py``: vLLM answered as
"input new, head base" to 3.6e-6). Serving the model untied (``--hf-overrides
'{"tie_word_embeddings": false}'``, ``streamrl.local.vllm``) from checkpoints that carry
``lm_head.weight`` makes every version load into the head too. transformers still ties the
two on load (the file's head is the embedding's copy), so nothing else changes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

WEIGHTS_FILE = "model.safetensors"  # a whole model's one weights file (save_pretrained's name)
_EMBED = "model.embed_tokens.weight"
_HEAD = "lm_head.weight"


def ties_head(directory: str | Path) -> bool:
    """Whether the model saved in ``directory`` ties its head to its embedding."""
    config = json.loads((Path(directory) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def write_explicit_head(directory: str | Path) -> bool:
    """Add ``lm_head.weight`` (a copy of the embedding) to a tied model's single
    ``model.safetensors``; False when there is nothing to do (untied, already there, an
    adapter or a sharded checkpoint). Written to a temporary file, then renamed."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    directory = Path(directory)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file() or not ties_head(directory):
        return False
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        names = list(f.keys())
        if _HEAD in names or _EMBED not in names:
            return False
        tensors = {name: f.get_tensor(name) for name in names}
        metadata = f.metadata() or {}
    tensors[_HEAD] = tensors[_EMBED].clone()
    tmp = weights.with_name(f".{WEIGHTS_FILE}.{os.getpid()}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", **metadata})
    tmp.replace(weights)
    return True
