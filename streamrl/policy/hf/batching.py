"""``HFPolicy``: requests from many episodes, answered in micro-batches.

The rollout worker runs many episodes as coroutines, each awaiting ``respond``. Requests that
arrive while the model is idle (in the same event-loop tick) or while a batch is generating
are queued, and the next batch takes up to ``max_batch`` of them into **one** decode call,
which runs in a thread so the event loop, and with it tool calls, heartbeats and Redis I/O,
keeps running: always the same thread, which also loads the model and its versions
(``compute``: torch's OpenMP threads are fast only when one thread makes torch calls). Only
one batch runs at a time, and weights change only between batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig
from streamrl.defaults import DEFAULT_RUN
from streamrl.envs.base import Environment
from streamrl.models.local import require_model_dir
from streamrl.policy import _chat
from streamrl.policy.base import Policy, PolicyError, PolicyRequest
from streamrl.policy.hf.compute import ComputeThread
from streamrl.policy.hf.decode import Decoder, Sampler, uniforms
from streamrl.policy.hf.weights import ServedWeights, VersionWatch
from streamrl.policy.token_text import TokenizerText
from streamrl.schema import ModelTurn, PolicyVersion

_RENDER_CACHE_SIZE = 4096
_RENDER_KEY = msgspec.msgpack.Encoder()

_DEFAULT_MAX_BATCH = 32
_DEFAULT_RELOAD_CHECK_S = 1.0
_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}
_DTYPES |= {"float16": "float16", "fp16": "float16", "half": "float16"}


@dataclass
class _Pending:
    request: PolicyRequest
    future: asyncio.Future[ModelTurn]
    prompt_ids: list[int] = field(default_factory=list)
    queued_at: float = field(default_factory=time.monotonic)


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
        self.max_batch = int(opts.get("max_batch", _DEFAULT_MAX_BATCH))
        self.seed = int(opts.get("seed", 0))
        # "loop": streamrl's own decode loop (each distinct prompt prefilled once);
        # "generate": transformers' generate (what any architecture supports)
        self.decode = str(opts.get("decode", "loop"))
        if self.decode not in ("loop", "generate"):
            raise ValueError(f"policy option decode must be loop or generate, not {self.decode!r}")
        ignore_eos = bool(opts.get("ignore_eos", False))  # benchmarks: every row to its limit
        if ignore_eos and self.decode != "loop":
            raise ValueError("policy option ignore_eos needs decode = loop")
        self.device = _device(str(opts.get("device", "auto")))
        dtype = str(opts.get("dtype", "auto"))
        torch_dtype: Any = "auto" if dtype == "auto" else getattr(torch, _DTYPES[dtype])
        trust = bool(opts.get("trust_remote_code", False))

        self.tokenizer = AutoTokenizer.from_pretrained(config.model, trust_remote_code=trust)
        self.tokenizer.padding_side = "left"
        self._compute = ComputeThread()

        def load() -> Any:
            model = AutoModelForCausalLM.from_pretrained(
                config.model, dtype=torch_dtype, trust_remote_code=trust
            )
            return model.to(self.device).eval()

        model = self._compute.run(load)
        # oneDNN on packed weights in the decode loop (CPU; packed_head: its name before)
        packed = bool(opts.get("packed_weights", opts.get("packed_head", True)))
        self._decoder = Decoder.of(model, self.tokenizer, ignore_eos, packed)
        self._template_takes_tools = "tools" in (self.tokenizer.chat_template or "")
        # "auto": describe the tools in the system message when the template cannot take
        # them (SmolLM2); "off": the environment's prompt describes them itself.
        self.tool_prompt = str(opts.get("tool_prompt", "auto"))
        if self.tool_prompt not in ("auto", "off"):
            raise ValueError(
                f"policy option tool_prompt must be auto or off, not {self.tool_prompt!r}"
            )

        self._weights = ServedWeights(model, self.device)
        self._watch = VersionWatch(
            self._weights,
            self._compute,
            redis_url,
            Keys(run),
            check_s=float(opts.get("reload_check_s", _DEFAULT_RELOAD_CHECK_S)),
            # serve the version announced `lag_versions` before the newest: rollouts
            # deliberately held back, to measure how well the learner's off-policy correction
            # copes
            lag=int(opts.get("lag_versions", 0)),
        )

        self._queue: list[_Pending] = []
        self._runner: asyncio.Task[None] | None = None
        self._closed = False
        # Observability (and what the tests look at): one entry per decode call.
        self.generate_calls = 0
        self.batch_sizes: list[int] = []
        self._render_cache: dict[bytes, list[int]] = {}
        self.full_renders = 0  # later turns that could not continue the previous turn's tokens
        self._session_tokens: TokenizerText | None = None

    @property
    def model(self) -> Any:
        """The model answering now (wrapped by peft while a LoRA version is served)."""
        return self._weights.model

    @property
    def version(self) -> int:
        return self._weights.version

    @property
    def reload_error(self) -> str | None:
        return self._watch.error

    def session_tokens(self) -> TokenizerText:
        if self._session_tokens is None:
            self._session_tokens = TokenizerText(self.tokenizer)
        return self._session_tokens

    # ------------------------------------------------------------------ public API

    async def respond(self, request: PolicyRequest) -> ModelTurn:
        if self._closed:
            raise PolicyError("the hf policy is closed")
        loop = asyncio.get_running_loop()
        pending = _Pending(request, loop.create_future())
        pending.prompt_ids = self._continue(request) or self._render_cached(request)
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
        await self._watch.close()
        self._compute.close()

    def load(self, pv: PolicyVersion) -> None:
        """Serve ``pv`` now, as a rollout worker does when the learner announces it (held-out
        evaluation calls this for a given checkpoint; no batch may be running)."""
        self._compute.run(self._weights.load, pv)

    def _render_cached(self, request: PolicyRequest) -> list[int]:
        """Prompt token ids, cached: the samples of a group share their prompt, and rendering a
        chat template costs more than generating a few tokens with a small model."""
        with_tools = self._template_takes_tools or self.tool_prompt == "auto"
        tools = request.tools if with_tools else []
        key = _RENDER_KEY.encode((request.items, tools))
        ids = self._render_cache.get(key)
        if ids is None:
            ids = self._render(request)
            self._render_cache[key] = ids
            if len(self._render_cache) > _RENDER_CACHE_SIZE:
                self._render_cache.pop(next(iter(self._render_cache)))
        return list(ids)

    def _render(self, request: PolicyRequest) -> list[int]:
        """The chat template over the conversation so far, with the tools when the template
        knows about tools."""
        text = self._template(request, request.items, generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _template(self, request: PolicyRequest, items: list, *, generation_prompt: bool) -> str:
        inline = not self._template_takes_tools
        messages = _chat.to_messages(items, arguments_as_dict=True, inline_tool_calls=inline)
        kwargs: dict[str, Any] = {}
        if request.tools and self._template_takes_tools:
            kwargs["tools"] = _chat.to_tools(request.tools)
        elif request.tools and self.tool_prompt == "auto":
            messages = _chat.with_system(messages, _chat.tool_prompt(request.tools))
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **kwargs
        )

    def _continue(self, request: PolicyRequest) -> list[int] | None:
        """A later turn's prompt as the previous turn's exact tokens (its prompt and what the
        model sampled) followed by the template's rendering of what came since (tool outputs,
        a user's reply). Re-rendering the whole conversation instead would re-tokenize the
        model's own words, which need not give back the sampled ids (the learner would then
        train on tokens the sampler never produced). None: render in full (a first turn, or a
        template whose output for the earlier conversation is not a prefix of the new one)."""
        prev = request.previous
        if prev is None or not prev.token_ids:
            return None
        cut = _chat.since_model(request.items)
        if cut == len(request.items):
            return None  # nothing came since the model's turn
        eos = self.tokenizer.eos_token or ""
        before = self._template(request, request.items[:cut], generation_prompt=False)
        end = before.rfind(eos) + len(eos) if eos and eos in before else -1
        full = self._template(request, request.items, generation_prompt=True)
        if end < 0 or full[:end] != before[:end]:
            self.full_renders += 1
            return None
        ids = [*prev.prompt_token_ids, *prev.token_ids]
        if ids[-1] not in self._decoder.eos_ids:  # cut at max_new_tokens: the template ends it
            ids.append(self._decoder.eos_ids[0])
        delta = self.tokenizer(full[end:], add_special_tokens=False)["input_ids"]
        return ids + list(delta)

    # ------------------------------------------------------------------ batching

    async def _run(self) -> None:
        while True:
            await self._fresh_check()
            if not self._queue:
                return
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
            batch = [p for p in batch if not p.future.done()]  # callers that gave up
            if not batch:
                continue
            try:
                turns = await self._compute.call(self._generate, batch)
            except Exception as e:
                err = PolicyError(f"hf generate failed: {e!r}")
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(err)
                continue
            for p, turn in zip(batch, turns, strict=True):
                if not p.future.done():  # the caller may have been cancelled
                    p.future.set_result(turn)

    async def _fresh_check(self) -> None:
        """Look for a new version, again if a request came in while looking: a version
        announced before a request was queued serves it (``reload_check_s`` permitting), even
        when the check that began before it read the stream first."""
        for _ in range(3):
            started = time.monotonic()
            await self._watch.check()
            if not any(p.queued_at >= started for p in self._queue[: self.max_batch]):
                return

    def _generate(self, batch: list[_Pending]) -> list[ModelTurn]:
        """One decode call over the batch (runs on the compute thread)."""
        import torch

        started = time.perf_counter()
        self.generate_calls += 1
        self.batch_sizes.append(len(batch))
        limits = [p.request.max_new_tokens or self.config.max_new_tokens for p in batch]
        width = max(len(p.prompt_ids) for p in batch)
        pad = [self._decoder.pad_id] * width
        # left-padded rows built as lists, one tensor each: two tensor writes per row took
        # 0.7-0.8 ms of a tiny model's ~12-ms batch of 64
        input_ids = torch.tensor([pad[len(p.prompt_ids) :] + p.prompt_ids for p in batch])
        attention = torch.tensor([[0] * (width - len(p.prompt_ids)) + [1] * len(p.prompt_ids)
                                  for p in batch])  # fmt: skip
        steps = max(limits)
        seeds = [
            _chat.request_seed(self.seed, p.request.task.task_id, p.request.turn) for p in batch
        ]
        u = torch.tensor(
            [uniforms(s, steps) for s in seeds], dtype=torch.float32, device=self.device
        )
        sampler = Sampler(u, self.config.temperature)
        with torch.inference_mode():
            ids, mask = input_ids.to(self.device), attention.to(self.device)
            loop, heads = self.decode == "loop", _shared_heads(batch)
            self._decoder.sample(self.model, ids, mask, sampler, steps, loop=loop, heads=heads)
        seconds = time.perf_counter() - started
        turns = []
        for i, p in enumerate(batch):
            tokens, logprobs, finish, text_ids = self._decoder.cut(
                sampler.tokens[i], sampler.logprobs[i], limits[i]
            )
            text = self.tokenizer.decode(text_ids, skip_special_tokens=False)
            turns.append(
                ModelTurn(
                    index=p.request.turn,
                    items=_chat.parse_completion(text, p.request.turn),
                    prompt_token_ids=list(p.prompt_ids),
                    token_ids=tokens,
                    logprobs=logprobs,
                    policy_version=self.version,
                    finish_reason=finish,
                    seconds=seconds,
                )
            )
        return turns


def _shared_heads(batch: list[_Pending]) -> list[list[int]]:
    """Each row's leading tokens shared with the other rows of its prompt (a group's later
    turns share the first prompt and differ after it), at least one token short of the row
    so that every row has a tail. A row alone in its prompt takes the opening all rows share
    (the chat template's system prompt, a tool description), else all but its last token.
    The decode loop uses heads only where they save prefill (``decode._heads_pay``)."""
    by_prompt: dict[str, list[list[int]]] = {}
    for p in batch:
        by_prompt.setdefault(p.request.task.prompt_id, []).append(p.prompt_ids)
    common = {prompt_id: _common_prefix(rows) for prompt_id, rows in by_prompt.items()}
    alone = any(len(rows) == 1 for rows in by_prompt.values())  # else no row needs the opening
    everyone = _common_prefix([p.prompt_ids for p in batch]) if alone else 0
    heads = []
    for p in batch:
        prompt_id = p.request.task.prompt_id
        n = common[prompt_id] if len(by_prompt[prompt_id]) > 1 or not everyone else everyone
        heads.append(p.prompt_ids[: max(n, 1)])
    return heads


def _common_prefix(rows: list[list[int]]) -> int:
    """How many leading tokens all ``rows`` share, at most one short of the shortest."""
    n = min(len(r) for r in rows) - 1
    first = rows[0]
    for r in rows[1:]:
        n = next((j for j in range(n) if r[j] != first[j]), n)
    return n


def _device(name: str) -> Any:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)
