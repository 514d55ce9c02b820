"""``hf``: a transformers model in this process (CPU or GPU), with micro-batching.

The rollout worker runs many episodes as coroutines, each awaiting ``respond``. Requests that
arrive while the model is idle (in the same event-loop tick) or while a batch is generating
are queued, and the next batch takes up to ``max_batch`` of them into **one** ``generate``
call, which runs in a thread (``asyncio.to_thread``) so the event loop, and with it tool
calls, heartbeats and Redis I/O, keeps running. Only one batch runs at a time.

Sampling. ``generate`` has a single global RNG, so we run it greedy over logits that a
logits processor (``_Sampler``) has already sampled from: for every row it draws the next
token from ``softmax(logits / temperature)`` with that request's own ``torch.Generator``
(seeded from task id + turn), records its log-probability, and hands ``generate`` a one-hot
row. This keeps ``generate``'s cache handling for every architecture, makes each request's
sample independent of what else is in the batch (up to float noise from padding), and gives
**behaviour log-probs under the sampling distribution**: ``log_softmax(logits / T)[token]``.
Those are what the learner uses as the denominator of its importance weights, and it must
compute its own log-probs at the same temperature. No top-k / top-p is applied, so nothing
the learner cannot reproduce shapes the distribution. ``temperature <= 0`` means greedy;
then the recorded log-probs are those of the untempered model (for evaluation only).

Tokens. ``token_ids`` are the sampled tokens up to and including the eos that ended the turn
(the eos is an action the learner must learn), with its log-prob; padding never appears.
The text is decoded without the final eos and *without* skipping other special tokens, so a
stray ``<bos>`` the model emits stays visible to the verifier.

Weights. Between batches (never during one) and at most every ``reload_check_s``, the
backend reads the last entry of the run's ``policy`` stream (XREVRANGE ... COUNT 1). A newer
``PolicyVersion`` is loaded in place: ``model.safetensors`` (full state dict, HF names) via
``load_state_dict``, or a LoRA adapter (``adapter_model.safetensors`` + ``adapter_config.json``)
via peft; peft is imported only for adapters, so full-weight training needs no peft. Every turn
is stamped with the version that generated it. A version that fails to load leaves the old
weights in place; ``reload_error`` says why until a later attempt succeeds, and the load is
retried every ``reload_check_s``. ``refresh()`` runs the same check when no batch is running.

Options (``PolicyConfig.options``): ``device`` (``auto`` | ``cpu`` | ``cuda`` | ``cuda:1``),
``dtype`` (``auto`` | ``float32`` | ``bfloat16`` | ``float16``), ``max_batch`` (32),
``reload_check_s`` (1.0), ``seed`` (0), ``trust_remote_code`` (false), ``lag_versions`` (0:
serve the newest version; N: the one announced N versions earlier, for off-policy experiments),
``decode`` (``loop``: streamrl's own KV-cache loop, which prefills each distinct prompt once,
so a group's samples share one prefill; ``generate``: transformers' ``generate``; both sample
through ``_Sampler`` and give the same tokens up to float noise).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig
from streamrl.defaults import DEFAULT_RUN, RELOAD_ERROR_LOG_EVERY_S
from streamrl.envs.base import Environment
from streamrl.log import Repeats
from streamrl.models.local import require_model_dir
from streamrl.policy import _chat
from streamrl.policy._versions import latest_version
from streamrl.policy.base import Policy, PolicyError, PolicyRequest
from streamrl.schema import ModelTurn, PolicyVersion

RENDER_CACHE_SIZE = 4096
_RENDER_KEY = msgspec.msgpack.Encoder()

log = structlog.get_logger(__name__)

DEFAULT_MAX_BATCH = 32
DEFAULT_RELOAD_CHECK_S = 1.0
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DTYPES |= {"float16": "float16", "fp16": "float16", "half": "float16"}


def _uniforms(seed: int, n: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.random() for _ in range(n)]


@dataclass
class _Pending:
    request: PolicyRequest
    future: asyncio.Future[ModelTurn]
    prompt_ids: list[int] = field(default_factory=list)


class _Sampler:
    """A ``generate`` logits processor that samples every row from ``softmax(logits / T)`` by
    inverse CDF with that row's own uniforms (drawn up front from its request's seed, so a
    request samples the same tokens alone or in any batch), and records the log-prob of what it
    drew (see the module docstring for why). Vectorized: one searchsorted per step."""

    def __init__(self, uniforms: Any, temperature: float) -> None:
        self.uniforms = uniforms  # [batch, max_new_tokens]
        self.temperature = temperature
        self.step = 0
        self.tokens: list[list[int]] = [[] for _ in range(uniforms.shape[0])]
        self.logprobs: list[list[float]] = [[] for _ in range(uniforms.shape[0])]

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        logits = scores.float()
        if self.temperature > 0:
            logp = torch.log_softmax(logits / self.temperature, dim=-1)
            cdf = logp.exp().cumsum(dim=-1)
            u = self.uniforms[:, self.step : self.step + 1] * cdf[:, -1:]
            nxt = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
        else:
            logp = torch.log_softmax(logits, dim=-1)
            nxt = logits.argmax(dim=-1)
        self.step += 1
        chosen = logp.gather(1, nxt[:, None])[:, 0]
        for i, (tok, lp) in enumerate(zip(nxt.tolist(), chosen.tolist(), strict=True)):
            self.tokens[i].append(tok)
            self.logprobs[i].append(lp)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, nxt[:, None], 0.0)
        return out


class HFPolicy(Policy):
    name = "hf"

    def __init__(
        self,
        config: PolicyConfig,
        env: Environment | None = None,
        *,
        redis_url: str | None = None,
        run: str = DEFAULT_RUN,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        require_model_dir(config.model, "policy.model")
        self.config = config
        self.env = env
        opts = config.options
        self.max_batch = int(opts.get("max_batch", DEFAULT_MAX_BATCH))
        self.reload_check_s = float(opts.get("reload_check_s", DEFAULT_RELOAD_CHECK_S))
        # serve the version announced `lag_versions` before the newest: rollouts deliberately
        # held back, to measure how well the learner's off-policy correction copes
        self.lag_versions = int(opts.get("lag_versions", 0))
        self.seed = int(opts.get("seed", 0))
        # "loop": streamrl's own decode loop (each distinct prompt prefilled once);
        # "generate": transformers' generate (what any architecture supports)
        self.decode = str(opts.get("decode", "loop"))
        if self.decode not in ("loop", "generate"):
            raise ValueError(f"policy option decode must be loop or generate, not {self.decode!r}")
        self.device = _device(str(opts.get("device", "auto")))
        dtype = str(opts.get("dtype", "auto"))
        torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, _DTYPES[dtype])
        trust = bool(opts.get("trust_remote_code", False))

        self.tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=trust)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=torch_dtype, trust_remote_code=trust
        ).to(self.device)
        self.model.eval()
        self.pad_id = _pad_id(self.tokenizer)
        self.eos_ids = _eos_ids(self.model, self.tokenizer)
        template = self.tokenizer.chat_template or ""
        self._template_takes_tools = "tools" in template

        self.keys = Keys(run)
        self._redis_url = redis_url
        self._redis: Any = None
        self._version = 0
        self._reload_error: str | None = None
        self._lora_config: dict[str, Any] | None = None
        self._last_check = float("-inf")
        self._repeats = Repeats(RELOAD_ERROR_LOG_EVERY_S)  # a failing reload retries each batch

        self._queue: list[_Pending] = []
        self._runner: asyncio.Task[None] | None = None
        self._closed = False
        # Observability (and what the tests look at): one entry per generate call.
        self.generate_calls = 0
        self.batch_sizes: list[int] = []
        self._render_cache: dict[bytes, list[int]] = {}

    @property
    def version(self) -> int:
        return self._version

    @property
    def reload_error(self) -> str | None:
        return self._reload_error

    # ------------------------------------------------------------------ public API

    async def respond(self, request: PolicyRequest) -> ModelTurn:
        if self._closed:
            raise PolicyError("the hf policy is closed")
        loop = asyncio.get_running_loop()
        pending = _Pending(request, loop.create_future())
        pending.prompt_ids = self.render(request)
        self._queue.append(pending)
        if self._runner is None or self._runner.done():
            # Started as a task, so it first runs after every coroutine that is ready in this
            # tick has queued its request: those all land in the same batch.
            self._runner = asyncio.create_task(self._run())
        return await pending.future

    async def refresh(self) -> None:
        """Check for a newer version now, or, while batches are running, leave it to the
        batch loop (weights never change during a batch). Returns when the batch loop is idle
        again, so after the first call the version and ``reload_error`` are up to date."""
        if self._closed:
            return
        if self._runner is None or self._runner.done():
            self._runner = asyncio.create_task(self._run())
        await asyncio.wait({self._runner})  # not `await`: a cancelled caller must not cancel it

    async def close(self) -> None:
        self._closed = True
        if self._runner is not None:
            with contextlib.suppress(Exception):  # already reported to the waiting requests
                await self._runner
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    def render(self, request: PolicyRequest) -> list[int]:
        """Prompt token ids, cached: the samples of a group share their prompt, and rendering a
        chat template costs more than generating a few tokens with a small model."""
        tools = request.tools if self._template_takes_tools else []
        key = _RENDER_KEY.encode((request.items, tools))
        ids = self._render_cache.get(key)
        if ids is None:
            ids = self._render(request)
            self._render_cache[key] = ids
            if len(self._render_cache) > RENDER_CACHE_SIZE:
                self._render_cache.pop(next(iter(self._render_cache)))
        return list(ids)

    def _render(self, request: PolicyRequest) -> list[int]:
        """The chat template over the conversation so far, with the tools when the template
        knows about tools."""
        messages = _chat.to_messages(request.items, arguments_as_dict=True)
        kwargs: dict[str, Any] = {}
        if request.tools and self._template_takes_tools:
            kwargs["tools"] = _chat.to_tools(request.tools)
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ batching

    async def _run(self) -> None:
        while True:
            await self._reload()
            if not self._queue:
                return
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            batch = [p for p in batch if not p.future.done()]  # callers that gave up
            if not batch:
                continue
            try:
                turns = await asyncio.to_thread(self._generate, batch)
            except Exception as e:
                err = PolicyError(f"hf generate failed: {e!r}")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(err)
                continue
            for p, turn in zip(batch, turns, strict=True):
                if not p.future.done():  # the caller may have been cancelled
                    p.future.set_result(turn)

    def _generate(self, batch: list[_Pending]) -> list[ModelTurn]:
        """One ``generate`` over the batch (runs in a worker thread)."""
        import torch
        from transformers import GenerationConfig, LogitsProcessorList

        started = time.perf_counter()
        self.generate_calls += 1
        self.batch_sizes.append(len(batch))
        limits = [p.request.max_new_tokens or self.config.max_new_tokens for p in batch]
        width = max(len(p.prompt_ids) for p in batch)
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            n = len(p.prompt_ids)
            input_ids[i, width - n :] = torch.tensor(p.prompt_ids)
            attention[i, width - n :] = 1
        steps = max(limits)
        uniforms = torch.tensor(
            [
                _uniforms(
                    _chat.request_seed(self.seed, p.request.task.task_id, p.request.turn), steps
                )
                for p in batch
            ],
            dtype=torch.float32,
            device=self.device,
        )
        sampler = _Sampler(uniforms, self.config.temperature)
        # Explicit neutral values: generate() fills every field we leave None from the model's
        # generation_config.json (a shipped repetition penalty or min length would silently
        # reshape the distribution the learner believes we sampled from).
        gen_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=max(limits),
            min_new_tokens=0,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            suppress_tokens=[],
            begin_suppress_tokens=[],
            renormalize_logits=False,
        )
        with torch.inference_mode():
            ids, mask = input_ids.to(self.device), attention.to(self.device)
            if not (self.decode == "loop" and self._decode_loop(ids, mask, sampler, steps)):
                self.model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    generation_config=gen_config,
                    logits_processor=LogitsProcessorList([sampler]),
                )
        seconds = time.perf_counter() - started
        turns = []
        for i, p in enumerate(batch):
            tokens, logprobs = sampler.tokens[i], sampler.logprobs[i]
            end = next((j for j, t in enumerate(tokens) if t in self.eos_ids), None)
            if end is not None and end < limits[i]:
                tokens, logprobs, finish = tokens[: end + 1], logprobs[: end + 1], "stop"
                text_ids = tokens[:-1]
            else:
                tokens, logprobs, finish = tokens[: limits[i]], logprobs[: limits[i]], "length"
                text_ids = tokens
            text = self.tokenizer.decode(text_ids, skip_special_tokens=False)
            turns.append(
                ModelTurn(
                    index=p.request.turn,
                    items=_chat.parse_completion(text, p.request.turn),
                    prompt_token_ids=list(p.prompt_ids),
                    token_ids=tokens,
                    logprobs=logprobs,
                    policy_version=self._version,
                    finish_reason=finish,
                    seconds=seconds,
                )
            )
        return turns

    def _decode_loop(self, ids: Any, mask: Any, sampler: _Sampler, steps: int) -> bool:
        """Sample ``steps`` tokens per row with the KV cache, each distinct prompt prefilled
        once (a group's samples share theirs: 8 rows of ``copy``, one prefill). What
        ``generate`` would do over the one-hot rows ``_Sampler`` hands it, without its
        per-call set-up, which dominates small models. False (nothing sampled) when the
        model's cache cannot be shared out by row, and ``generate`` is used instead."""
        import torch

        rows = torch.cat([ids, mask], dim=1)
        distinct, row_prompt = torch.unique(rows, dim=0, return_inverse=True)
        width = ids.size(1)
        p_ids, p_mask = distinct[:, :width], distinct[:, width:]
        positions = (p_mask.cumsum(-1) - 1).clamp_(min=0)  # left padding, as generate has it
        out = self.model(
            input_ids=p_ids, attention_mask=p_mask, position_ids=positions, use_cache=True
        )
        cache = out.past_key_values
        if not hasattr(cache, "reorder_cache"):
            return False
        cache.reorder_cache(row_prompt)
        scores = out.logits[row_prompt, -1]
        position = positions[row_prompt, -1]
        eos = torch.tensor(self.eos_ids, device=ids.device)
        done = torch.zeros(ids.size(0), dtype=torch.bool, device=ids.device)
        for step in range(steps):
            token = sampler(None, scores).argmax(dim=-1)
            done |= torch.isin(token, eos)
            if step == steps - 1 or bool(done.all()):
                break
            token = token.masked_fill(done, self.pad_id)  # finished rows carry padding on
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position = position + 1
            out = self.model(
                input_ids=token[:, None],
                attention_mask=mask,
                position_ids=position[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            cache, scores = out.past_key_values, out.logits[:, -1]
        return True

    # ------------------------------------------------------------------ weights

    async def _reload(self) -> None:
        try:
            await self._maybe_reload()
        except Exception as e:  # a bad checkpoint must not stop rollouts: keep the old weights
            self._reload_error = f"{type(e).__name__}: {e}"
            skipped = self._repeats.check("reload", self._reload_error)
            if skipped is not None:
                log.error(
                    "policy reload failed", error=repr(e), run=self.keys.run,
                    policy_version=self._version, repeats_not_logged=skipped,
                )  # fmt: skip

    async def _maybe_reload(self) -> None:
        if self._redis_url is None or time.monotonic() - self._last_check < self.reload_check_s:
            return
        self._last_check = time.monotonic()
        latest = await self._latest_version()
        if latest is None or latest.version <= self._version or latest.format == "none":
            self._reload_error = None  # serving what we should
            return
        await asyncio.to_thread(self._load, latest)
        self._reload_error = None
        self._repeats.clear("reload")
        log.info(
            "policy reloaded", policy_version=latest.version, path=latest.path, run=self.keys.run
        )

    async def _latest_version(self) -> PolicyVersion | None:
        if self._redis is None:
            from streamrl.connection import connect_async

            self._redis = connect_async(self._redis_url, resilient=True)
        return await latest_version(self._redis, self.keys, lag=self.lag_versions)

    def _load(self, pv: PolicyVersion) -> None:
        """Swap weights in place (called between batches only)."""
        if pv.format == "lora":
            self._load_lora(Path(pv.path))
        else:
            self._load_full(Path(pv.path) / "model.safetensors")
        self._version = pv.version

    def _load_full(self, file: Path) -> None:
        """Checked before anything is copied, so a bad file leaves the old weights whole."""
        from safetensors.torch import load_file

        state = load_file(str(file), device=str(self.device))
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

    def _load_lora(self, directory: Path) -> None:
        from peft import PeftModel, set_peft_model_state_dict
        from safetensors.torch import load_file

        config = json.loads((directory / "adapter_config.json").read_text())
        same_shape = self._lora_config is not None and all(
            config.get(k) == self._lora_config.get(k)
            for k in ("r", "target_modules", "lora_alpha", "modules_to_save", "use_dora")
        )
        if isinstance(self.model, PeftModel) and same_shape:
            weights = load_file(
                str(directory / "adapter_model.safetensors"), device=str(self.device)
            )
            result = set_peft_model_state_dict(self.model, weights)
            if getattr(result, "unexpected_keys", None):
                raise PolicyError(
                    f"{directory}: unexpected adapter keys {result.unexpected_keys[:5]}"
                )
        else:
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


# ---------------------------------------------------------------------- helpers


def _device(name: str) -> Any:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def _pad_id(tokenizer: Any) -> int:
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    return 0


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Every token that ends a turn: the generation config may list several (Llama 3)."""
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("the model has no eos token: cannot tell when a turn ends")
    return ids


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
