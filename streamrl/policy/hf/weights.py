"""The weights the ``hf`` backend serves, and following the learner's policy versions.

Between batches (never during one) and at most every ``reload_check_s``, the backend reads the
last entry of the run's ``policy`` stream (XREVRANGE ... COUNT 1). A newer ``PolicyVersion``
is loaded in place: ``model.safetensors`` (full state dict, HF names) via ``load_state_dict``,
or a LoRA adapter (``adapter_model.safetensors`` + ``adapter_config.json``) via peft; peft is
imported only for adapters, so full-weight training needs no peft. Every turn is stamped with
the version that generated it. A version that fails to load leaves the old weights in place;
``reload_error`` says why until a later attempt succeeds, and the load is retried every
``reload_check_s``. ``refresh()`` runs the same check when no batch is running. The files are
checked against the version's sha256 digests before loading (``streamrl.policy.integrity``):
a tampered or truncated version is refused the same way.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from streamrl.bus.keys import Keys
from streamrl.defaults import RELOAD_ERROR_LOG_EVERY_S
from streamrl.log import Repeats
from streamrl.policy._versions import latest_version
from streamrl.policy.base import PolicyError
from streamrl.policy.hf.compute import ComputeThread
from streamrl.policy.integrity import verify_dir
from streamrl.schema import PolicyVersion

log = structlog.get_logger("streamrl.policy.hf")


class ServedWeights:
    """The model being served and the policy version it holds. ``load`` swaps weights in
    place; a LoRA version wraps the model with peft, a full-weights one unwraps it."""

    def __init__(self, model: Any, device: Any) -> None:
        self.model = model
        self.device = device
        self.version = 0
        self._lora_config: dict[str, Any] | None = None

    def load(self, pv: PolicyVersion) -> None:
        """Serve ``pv`` from now on (called between batches only). The files are checked
        against the announced digests first; a mismatch raises before anything changes."""
        if pv.format == "lora":
            self._load_lora(Path(pv.path), pv.digests)
        else:
            self._load_full(Path(pv.path), pv.digests)
        self.version = pv.version

    def _load_full(self, directory: Path, digests: dict[str, str]) -> None:
        """Checked before anything is copied, so a bad file leaves the old weights whole."""
        from safetensors.torch import load

        file = directory / "model.safetensors"
        data = verify_dir(directory, digests, read=(file.name,))[file.name]
        state = {k: v.to(self.device) for k, v in load(data).items()}
        model = self._base_model()
        current = model.state_dict()
        tied = _tied_names(model)
        missing = [k for k in current if k not in state and k not in tied]
        unexpected = [k for k in state if k not in current]
        wrong = [k for k in state if k in current and state[k].shape != current[k].shape]
        if missing or unexpected or wrong:
            raise PolicyError(
                f"{file}: state dict does not match the model (missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]})"
            )
        model.load_state_dict(state, strict=False)

    def _load_lora(self, directory: Path, digests: dict[str, str]) -> None:
        from peft import PeftModel, set_peft_model_state_dict
        from safetensors.torch import load

        config = json.loads((directory / "adapter_config.json").read_text())
        same_shape = self._lora_config is not None and all(
            config.get(k) == self._lora_config.get(k)
            for k in ("r", "target_modules", "lora_alpha", "modules_to_save", "use_dora")
        )
        if isinstance(self.model, PeftModel) and same_shape:
            adapter = "adapter_model.safetensors"
            data = verify_dir(directory, digests, read=(adapter,))[adapter]
            weights = {k: v.to(self.device) for k, v in load(data).items()}
            result = set_peft_model_state_dict(self.model, weights)
            if getattr(result, "unexpected_keys", None):
                raise PolicyError(
                    f"{directory}: unexpected adapter keys {result.unexpected_keys[:5]}"
                )
        else:
            verify_dir(directory, digests)  # peft reads the files itself, just after
            base = self._base_model()
            self.model = PeftModel.from_pretrained(base, str(directory)).to(self.device)
            self.model.eval()
        self._lora_config = config

    def _base_model(self) -> Any:
        """The plain transformers model: a full-weights version replaces any LoRA. The model
        can only be a peft model if peft was imported (by ``_load_lora``), so full weights
        never import it."""
        peft = sys.modules.get("peft")
        if peft is not None and isinstance(self.model, peft.PeftModel):
            self.model = self.model.unload()
            self._lora_config = None
        return self.model


class VersionWatch:
    """Loads the newest announced version (or the one ``lag`` announcements before it) into
    ``weights``, at most every ``check_s``; without a Redis URL, never. Loads run on the
    policy's ``compute`` thread, where its decode calls run."""

    def __init__(
        self,
        weights: ServedWeights,
        compute: ComputeThread,
        redis_url: str | None,
        keys: Keys,
        check_s: float,
        lag: int,
    ) -> None:
        self.weights = weights
        self._compute = compute
        self.keys = keys
        self._redis_url = redis_url
        self._check_s = check_s
        self._lag = lag
        self._redis: Any = None
        self._last_check = float("-inf")
        self.error: str | None = None  # why the last load failed; None once serving the newest
        self._repeats = Repeats(RELOAD_ERROR_LOG_EVERY_S)  # a failing reload retries each batch

    async def check(self) -> None:
        """Never raises: a bad checkpoint must not stop rollouts, the old weights stay."""
        try:
            await self._maybe_reload()
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            skipped = self._repeats.check("reload", self.error)
            if skipped is not None:
                log.error(
                    "policy reload failed", error=repr(e), run=self.keys.run,
                    policy_version=self.weights.version, repeats_not_logged=skipped,
                )  # fmt: skip

    async def close(self) -> None:
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def _maybe_reload(self) -> None:
        if self._redis_url is None or time.monotonic() - self._last_check < self._check_s:
            return
        self._last_check = time.monotonic()
        if self._redis is None:
            from streamrl.connection import connect_async

            self._redis = connect_async(self._redis_url, resilient=True)
        latest = await latest_version(self._redis, self.keys, lag=self._lag)
        if latest is None or latest.version <= self.weights.version or latest.format == "none":
            self.error = None  # serving what we should
            return
        await self._compute.call(self.weights.load, latest)
        self.error = None
        self._repeats.clear("reload")
        log.info(
            "policy reloaded", policy_version=latest.version, path=latest.path, run=self.keys.run
        )


def _tied_names(model: Any) -> set[str]:
    """Parameters that are aliases of another one (tied embeddings) need not be in a file."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(name)
        seen.setdefault(id(tensor), name)
    tied.update(getattr(model, "_tied_weights_keys", None) or [])
    return tied
