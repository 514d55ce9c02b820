"""A vLLM worker extension that loads a streamrl checkpoint directory into the running model.

Start the server with::

    VLLM_SERVER_DEV_MODE=1 vllm serve <base model> --logprobs-mode processed_logprobs \\
        --worker-extension-cls streamrl.policy.vllm_ext.WeightLoader

and the ``openai`` backend (``sync = "weights"``) calls, through vLLM's dev endpoint
``POST /collective_rpc {"method": "streamrl_load_weights", "args": ["<dir>"]}``, the method
below in every worker (every tensor-parallel rank). ``model.load_weights`` is vLLM's own
loader for HF-named checkpoints: it maps ``q_proj``/``k_proj``/``v_proj`` onto fused
parameters and shards them for this rank, exactly as at start-up.

Why an extension rather than vLLM's ``reload_weights``: on many releases that re-reads the
*original* model path, not a new one. Needs a vLLM with ``--worker-extension-cls`` and the
dev-mode ``/collective_rpc`` endpoint (recent releases). Not exercised by the CPU test suite:
there is no vLLM (and no GPU) there; the test server calls ``iter_safetensors`` only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

_WEIGHTS_FILE = "model.safetensors"


def iter_safetensors(directory: str | Path) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs of ``model.safetensors`` (or sharded ``model-*.safetensors``),
    read lazily so a large checkpoint is never twice in host memory."""
    from safetensors import safe_open

    directory = Path(directory)
    files = (
        [directory / _WEIGHTS_FILE]
        if (directory / _WEIGHTS_FILE).exists()
        else sorted(directory.glob("model-*.safetensors"))
    )
    if not files:
        raise FileNotFoundError(f"no {_WEIGHTS_FILE} in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


class WeightLoader:
    """Mixed into vLLM's GPU worker by ``--worker-extension-cls``; ``self.model_runner`` is
    the worker's."""

    model_runner: Any

    def streamrl_load_weights(self, directory: str) -> int:
        """Load every tensor of ``directory`` into the served model; returns how many."""
        import torch

        model = self.model_runner.model
        count = 0

        def weights() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for item in iter_safetensors(directory):
                count += 1
                yield item

        with torch.no_grad():
            model.load_weights(weights=weights())
        try:  # quantised / repacked layers re-derive their kernels' weights
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            device = next(model.parameters()).device
            process_weights_after_loading(model, self.model_runner.model_config, device)
        except ImportError:
            pass
        return count
