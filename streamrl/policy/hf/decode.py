"""From a batch of prompts to sampled tokens and their log-probs: the sampler, the KV-cache
decode loop, and transformers' ``generate`` as the fallback.

Sampling. ``generate`` has a single global RNG, so we run it greedy over logits that a
logits processor (``Sampler``) has already sampled from: for every row it draws the next
token from ``softmax(logits / temperature)`` with that request's own uniforms (seeded from
task id + turn), records its log-probability, and hands ``generate`` a one-hot row. This keeps
``generate``'s cache handling for every architecture, makes each request's sample independent
of what else is in the batch (up to float noise from padding), and gives **behaviour log-probs
under the sampling distribution**: ``log_softmax(logits / T)[token]``. Those are what the
learner uses as the denominator of its importance weights, and it must compute its own
log-probs at the same temperature. No top-k / top-p is applied, so nothing the learner cannot
reproduce shapes the distribution. ``temperature <= 0`` means greedy; then the recorded
log-probs are those of the untempered model (for evaluation only).

Decoding (option ``decode``). ``loop``: streamrl's own KV-cache loop, which prefills each
distinct prompt once, so a group's samples share one prefill; ``generate``: transformers'
``generate``. Both sample through ``Sampler`` and give the same tokens up to float noise.
The loop runs a CPU model's large linear layers through oneDNN on packed weights (option
``packed_weights``, default true: ``streamrl.policy.hf.packed``).

Tokens. ``token_ids`` are the sampled tokens up to and including the eos that ended the turn
(the eos is an action the learner must learn), with its log-prob; padding never appears.
The text is decoded without the final eos and *without* skipping other special tokens, so a
stray ``<bos>`` the model emits stays visible to the verifier.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Any

from streamrl.models.kv import cache_of, with_cache


def uniforms(seed: int, n: int) -> list[float]:
    """A request's ``n`` uniforms, one per token it may sample."""
    rng = random.Random(seed)
    return [rng.random() for _ in range(n)]


class Sampler:
    """A ``generate`` logits processor that samples every row from ``softmax(logits / T)`` by
    inverse CDF with that row's own uniforms (drawn up front from its request's seed, so a
    request samples the same tokens alone or in any batch), and records the log-prob of what it
    drew (see the module docstring for why). Vectorized: two searchsorteds per step
    (``_inverse_cdf``)."""

    def __init__(self, uniforms: Any, temperature: float) -> None:
        self.uniforms = uniforms  # [batch, max_new_tokens]
        self.temperature = temperature
        self.step = 0
        self.tokens: list[list[int]] = [[] for _ in range(uniforms.shape[0])]
        self.logprobs: list[list[float]] = [[] for _ in range(uniforms.shape[0])]

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        """``generate``'s hook: the drawn tokens as one-hot rows for its greedy step."""
        import torch

        nxt = self.draw(scores)
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, nxt[:, None], 0.0)
        return out

    def draw(self, scores: Any) -> Any:
        """Each row's next token (recorded with its log-prob), from the last position's
        logits; the decode loop calls this directly, with no one-hot row to argmax."""
        import torch

        logits = scores.float()
        if self.temperature > 0:
            x = logits if self.temperature == 1 else logits / self.temperature
            nxt, log_z = _inverse_cdf(x, self.uniforms[:, self.step])
            chosen = x.gather(1, nxt[:, None])[:, 0] - log_z
        else:
            nxt = logits.argmax(dim=-1)
            chosen = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None])[:, 0]
        self.step += 1
        for i, (tok, lp) in enumerate(zip(nxt.tolist(), chosen.tolist(), strict=True)):
            self.tokens[i].append(tok)
            self.logprobs[i].append(lp)
        return nxt


BLOCK = 1024  # vocabulary entries summed together before the search goes inside one block


def _inverse_cdf(x: Any, u: Any) -> tuple[Any, Any]:
    """Each row's token drawn from ``softmax(x)`` with its uniform in ``u`` (the first token
    whose cumulative probability passes it), and the row's ``logsumexp(x)``. The vocabulary is
    cut in blocks: their sums place the draw in one block, whose entries alone are summed in
    order. A cumulative sum over the whole vocabulary and a ``log_softmax`` beside it made
    three full passes more (with 64 rows of SmolLM2's 49,152 logits, a fifth of a float32
    decode step on a 2-core CPU)."""
    import torch

    rows, vocab = x.shape
    m = x.amax(dim=-1, keepdim=True)
    e = (x - m).exp_()  # exp(-inf) = 0: masked tokens are never drawn
    size = min(BLOCK, vocab)  # a small vocabulary is one block, not padded to BLOCK
    blocks = -(-vocab // size)
    if blocks * size != vocab:
        e = torch.nn.functional.pad(e, (0, blocks * size - vocab))
    e = e.view(rows, blocks, size)
    upto = e.sum(dim=-1).cumsum(dim=-1)  # mass up to the end of each block
    total = upto[:, -1:]
    # below each sum it searches, so that rounding never lands past the last token with any
    # mass (a masked one, log-prob -inf: a draw of u near 1 did)
    zero = torch.zeros_like(total)
    target = torch.minimum(u[:, None].to(total.dtype) * total, torch.nextafter(total, zero))
    block = torch.searchsorted(upto, target, right=True).clamp_(max=blocks - 1)  # [rows, 1]
    before = torch.where(block > 0, upto.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = e.gather(1, block[:, :, None].expand(rows, 1, size))[:, 0].cumsum(dim=-1)
    within = torch.minimum(target - before, torch.nextafter(inside[:, -1:], zero)).clamp_(min=0)
    at = torch.searchsorted(inside, within, right=True).clamp_(max=size - 1)
    nxt = (block * size + at)[:, 0].clamp_(max=vocab - 1)
    return nxt, m[:, 0] + total[:, 0].log()


@dataclass(frozen=True)
class Decoder:
    """What ends a turn (``eos_ids``) and what fills finished rows (``pad_id``), read once
    from the model and its tokenizer; ``packed``: the decode loop's packed linear layers
    (``streamrl.policy.hf.packed``), None for the model's own."""

    eos_ids: list[int]
    pad_id: int
    ignore_eos: bool = False  # every row runs to its limit (benchmarks: equal work per row)
    packed: Any = None

    @classmethod
    def of(
        cls, model: Any, tokenizer: Any, ignore_eos: bool = False, packed: bool = True
    ) -> Decoder:
        linears = None
        if packed:
            from streamrl.policy.hf.packed import PackedLinears

            linears = PackedLinears()
        return cls(_eos_ids(model, tokenizer), _pad_id(tokenizer), ignore_eos, linears)

    def sample(
        self,
        model: Any,
        ids: Any,
        mask: Any,
        sampler: Sampler,
        steps: int,
        loop: bool,
        heads: list[list[int]] | None = None,
    ) -> None:
        """Sample ``steps`` tokens per row into ``sampler``: with the decode loop when
        ``loop`` and the model's cache allows it, else with ``generate``. ``heads``: each
        row's leading tokens that other rows share (see ``_prefill_heads``)."""
        from transformers import GenerationConfig, LogitsProcessorList

        if loop:
            with self.packed.on(model) if self.packed is not None else contextlib.nullcontext():
                if self._loop(model, ids, mask, sampler, steps, heads):
                    return
        if self.ignore_eos:  # generate() would stop rows at eos, or never sample it
            raise ValueError("policy option ignore_eos needs the decode loop (decode = loop)")
        # Explicit neutral values: generate() fills every field we leave None from the model's
        # generation_config.json (a shipped repetition penalty or min length would silently
        # reshape the distribution the learner believes we sampled from).
        gen_config = GenerationConfig(
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=0,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            suppress_tokens=[],
            begin_suppress_tokens=[],
            renormalize_logits=False,
        )
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=gen_config,
            logits_processor=LogitsProcessorList([sampler]),
        )

    def _loop(
        self,
        model: Any,
        ids: Any,
        mask: Any,
        sampler: Sampler,
        steps: int,
        heads: list[list[int]] | None = None,
    ) -> bool:
        """Sample ``steps`` tokens per row with the KV cache, each distinct prompt prefilled
        once (a group's samples share theirs: 8 rows of ``copy``, one prefill), or, with
        ``heads``, each distinct head once. What ``generate`` would do over the one-hot rows
        ``Sampler`` hands it, without its per-call set-up, which dominates small models.
        False (nothing sampled) when the model's cache cannot be shared out by row, and
        ``generate`` is used instead."""
        import torch

        # one pass over the distinct rows (a first turn's group is one prompt repeated), or
        # the distinct heads once and then every row's tail (later turns share the group's
        # first prompt; distinct prompts share the chat template's opening): whichever runs
        # fewer prompt positions
        distinct, row_prompt = torch.unique(torch.cat([ids, mask], dim=1), dim=0,
                                            return_inverse=True)  # fmt: skip
        if heads is not None and _heads_pay(heads, mask, distinct.size(0)):
            start = self._prefill_heads(model, ids, mask, heads)
        else:
            start = self._prefill(model, ids, mask, distinct, row_prompt)
        if start is None:
            return False
        from streamrl.policy.hf.cache import roomy

        cache, scores, mask, position = start
        roomy(cache, steps)
        width = mask.size(1)
        mask = torch.cat([mask, mask.new_ones((mask.size(0), steps))], dim=1)  # filled as it goes
        eos = torch.tensor(self.eos_ids, device=ids.device)
        done = torch.zeros(ids.size(0), dtype=torch.bool, device=ids.device)
        for step in range(steps):
            token = sampler.draw(scores)
            if not self.ignore_eos:
                done |= torch.isin(token, eos)
            if step == steps - 1 or bool(done.all()):
                break
            token = token.masked_fill(done, self.pad_id)  # finished rows carry padding on
            position = position + 1
            out = model(
                input_ids=token[:, None],
                attention_mask=mask[:, : width + step + 1],
                position_ids=position[:, None],
                use_cache=True,
                **with_cache(cache),
            )
            cache, scores = cache_of(out), out.logits[:, -1]
        return True

    def _prefill(
        self, model: Any, ids: Any, mask: Any, distinct: Any, row_prompt: Any
    ) -> tuple | None:
        """Each distinct left-padded prompt (``distinct``: the unique rows of ids and mask side
        by side, ``row_prompt``: each row's) run once; its cache handed to the rows that have it."""
        width = ids.size(1)
        p_ids, p_mask = distinct[:, :width], distinct[:, width:]
        positions = (p_mask.cumsum(-1) - 1).clamp_(min=0)  # left padding, as generate has it
        # logits of the last position only: all of them would be rows x width x vocab floats
        # (8.5 GB for 128 rows of 340 tokens over SmolLM2's 49,152-token vocabulary)
        out = model(input_ids=p_ids, attention_mask=p_mask, position_ids=positions,
                    use_cache=True, logits_to_keep=1)  # fmt: skip
        cache = cache_of(out)
        if not hasattr(cache, "reorder_cache"):
            return None
        cache.reorder_cache(row_prompt)
        return cache, out.logits[row_prompt, -1], mask, positions[row_prompt, -1]

    def _prefill_heads(
        self, model: Any, ids: Any, mask: Any, heads: list[list[int]]
    ) -> tuple | None:
        """Later turns of a group's episodes share the group's first prompt and differ after
        it. Run each distinct head once (left-padded), hand its cache to its rows, then run
        every row's tail (what follows its head, left-padded: padding sits between head and
        tail, masked) on top: a SmolLM2 ``lookup`` second turn prefills ~60 tokens per row
        instead of ~290."""
        import torch

        device = ids.device
        rows = [ids[i][mask[i].bool()].tolist() for i in range(ids.size(0))]
        tails = [r[len(h) :] for r, h in zip(rows, heads, strict=True)]
        h_width, t_width = max(len(h) for h in heads), max(len(t) for t in tails)
        h_ids = torch.full((len(rows), h_width), self.pad_id, dtype=torch.long)
        h_mask = torch.zeros((len(rows), h_width), dtype=torch.long)
        t_ids = torch.full((len(rows), t_width), self.pad_id, dtype=torch.long)
        t_mask = torch.zeros((len(rows), t_width), dtype=torch.long)
        for i, (h, t) in enumerate(zip(heads, tails, strict=True)):
            h_ids[i, h_width - len(h) :] = torch.tensor(h, dtype=torch.long)
            h_mask[i, h_width - len(h) :] = 1
            t_ids[i, t_width - len(t) :] = torch.tensor(t, dtype=torch.long)
            t_mask[i, t_width - len(t) :] = 1
        h_ids, h_mask, t_ids, t_mask = (x.to(device) for x in (h_ids, h_mask, t_ids, t_mask))
        distinct, row_head = torch.unique(
            torch.cat([h_ids, h_mask], dim=1), dim=0, return_inverse=True
        )
        d_ids, d_mask = distinct[:, :h_width], distinct[:, h_width:]
        d_pos = (d_mask.cumsum(-1) - 1).clamp_(min=0)
        out = model(input_ids=d_ids, attention_mask=d_mask, position_ids=d_pos,
                    use_cache=True, logits_to_keep=1)  # fmt: skip
        cache = cache_of(out)
        if not hasattr(cache, "reorder_cache"):
            return None
        cache.reorder_cache(row_head)
        full_mask = torch.cat([h_mask, t_mask], dim=1)
        t_pos = (h_mask.sum(-1, keepdim=True) + t_mask.cumsum(-1) - 1).clamp_(min=0)
        out = model(input_ids=t_ids, attention_mask=full_mask, position_ids=t_pos,
                    use_cache=True, logits_to_keep=1, **with_cache(cache))  # fmt: skip
        return cache_of(out), out.logits[:, -1], full_mask, t_pos[:, -1]

    def cut(
        self, tokens: list[int], logprobs: list[float], limit: int
    ) -> tuple[list[int], list[float], str, list[int]]:
        """A row's turn: its tokens and log-probs up to the first eos (kept) or ``limit``,
        the finish reason, and the token ids of its text (without that eos)."""
        end = None
        if not self.ignore_eos:
            end = next((j for j, t in enumerate(tokens) if t in self.eos_ids), None)
        if end is not None and end < limit:
            return tokens[: end + 1], logprobs[: end + 1], "stop", tokens[:end]
        return tokens[:limit], logprobs[:limit], "length", tokens[:limit]


def _heads_pay(heads: list[list[int]], mask: Any, distinct_rows: int) -> bool:
    """Whether the heads-then-tails prefill runs fewer positions (padding included) than one
    pass over the ``distinct_rows`` whole prompts, ``mask.size(1)`` wide."""
    lengths = mask.sum(-1).tolist()
    tails = max(n - len(h) for n, h in zip(lengths, heads, strict=True))
    distinct_heads = {tuple(h) for h in heads}
    heads_cost = len(distinct_heads) * max(len(h) for h in heads) + len(heads) * tails
    return heads_cost < distinct_rows * mask.size(1)


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
