"""Log-probabilities of a batch's rows under the model being trained: which positions run the
model and its output layer. A group's samples run their shared prompt once, and the output
layer (49,152 logits a position for SmolLM2) runs only where there is loss."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from streamrl.learner.losses import row_entropy, token_logps
from streamrl.models.kv import cache_of, with_cache


def sequence_logps(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float,
    prompt_lens: list[int] | None = None,
    start: int = 0,
) -> Tensor:
    """log π(token t+1 | tokens ≤ t) for positions ``start``..L-2: (B, L-1-start) (see
    ``shifted_logits``)."""
    logits = shifted_logits(model, input_ids, attention_mask, prompt_lens, start)
    return token_logps(logits, input_ids[:, start + 1 :], temperature)


def loss_start(prompt_lens: list[int] | None) -> int:
    """The first position that can carry loss: positions before the shortest prompt's last
    token predict prompt tokens. Their logits are never computed (``shifted_logits``'s
    ``start``): with SmolLM2's 49,152-token vocabulary a 45-token prompt's logits are as
    large as 45 completion tokens' and cost the same softmax passes, for nothing."""
    return max(0, min(prompt_lens) - 1) if prompt_lens else 0


def shifted_logits(
    model: nn.Module,
    ids: Tensor,
    attn: Tensor,
    prompt_lens: list[int] | None = None,
    start: int = 0,
) -> Tensor:
    """Logits at positions ``start``..L-2, (B, L-1-start, V): position t predicts token t+1.
    ``start`` at most the shortest prompt's length - 1 (``loss_start``); the language-model
    head runs only from there (``logits_to_keep``). Positions inside a shared prompt head
    (see ``_forward``) predict prompt tokens, which carry no loss: their logits come back 0."""
    first, rest, col = _forward(model, ids, attn, prompt_lens, start)
    if first is None:
        return rest
    before = first.new_zeros(ids.size(0), col, first.size(-1))
    return torch.cat([before, first[:, None], rest], dim=1)


def masked_logps(
    model: nn.Module,
    ids: Tensor,
    attn: Tensor,
    mask: Tensor,
    temperature: float,
    prompt_lens: list[int] | None = None,
    start: int = 0,
    entropy_grad: bool = False,
) -> tuple[Tensor, Tensor]:
    """``sequence_logps`` where ``mask`` (B, L-1-start) is set, 0 elsewhere, and the entropy of
    each of those positions, flat (N,). The output layer runs on those positions only: in a
    multi-turn row most positions after the first prompt are tool outputs, template glue and
    padding, which carry no loss, and with a 49,152-token vocabulary each position's logits
    cost as much as a transformer layer's work on it, forward and backward."""
    on = mask.bool()
    first, rest, col = _forward(model, ids, attn, prompt_lens, start, on)
    targets, rest_on = ids[:, start + 1 :], on[:, col + 1 :]
    logps = _scatter(rest_on, token_logps(rest, targets[:, col + 1 :][rest_on], temperature))
    entropy = _entropy(rest, temperature, entropy_grad)
    if first is None:
        return logps, entropy
    zeros = logps.new_zeros(ids.size(0), col)
    first_lp = torch.where(on[:, col], token_logps(first, targets[:, col], temperature), 0.0)
    logps = torch.cat([zeros, first_lp[:, None], logps], dim=1)
    # the entropies in the masked positions' row-major order, as without a shared head
    first_ent = _entropy(first, temperature, entropy_grad)
    entropy = torch.cat([zeros, first_ent[:, None], _scatter(rest_on, entropy)], dim=1)[on]
    return logps, entropy


def _forward(
    model: nn.Module,
    ids: Tensor,
    attn: Tensor,
    prompt_lens: list[int] | None,
    start: int,
    on: Tensor | None = None,
) -> tuple[Tensor | None, Tensor, int]:
    """The training forward of positions ``start``..L-2: ``(first, rest, col)``.

    With ``prompt_lens`` (each row's prompt length), rows that share a prompt run it once:
    the samples of a group do. With P the shortest prompt length, when some rows share their
    first P tokens, each distinct P-token head is run once, its keys and values are handed to
    every row that has it (an index_select, so gradients flow back through them), and only
    the rest of each row runs per row: a group of 8 ``copy`` samples costs 8 + 8 × 4 token
    positions instead of 8 × 12. The head's logits are computed at its last position only:
    ``first`` (B, V), at column ``col`` = P - 1 - ``start``; ``rest`` holds the columns after
    it. Otherwise one plain forward: ``first`` None, ``col`` -1, ``rest`` every column.

    ``rest`` is (B, columns, V), or with ``on`` (B, L-1-start) flat (N, V): the output layer
    then runs only where ``on[:, col + 1:]`` is set (``_output_rows``)."""
    width = ids.size(1)
    if prompt_lens and 1 <= min(prompt_lens) < width:
        length = min(prompt_lens)
        assert start <= length - 1, (start, length)
        prompts, row_prompt = torch.unique(ids[:, :length], dim=0, return_inverse=True)
        if prompts.size(0) < ids.size(0):
            head = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
            cache = cache_of(head)
            cache.reorder_cache(row_prompt)  # (distinct prompts) -> (rows), differentiable
            positions = torch.arange(length, width, device=ids.device).expand(ids.size(0), -1)
            col = length - 1 - start
            with _output_rows(model, None if on is None else on[:, col + 1 :]):
                tail = model(input_ids=ids[:, length:], attention_mask=attn,
                             position_ids=positions, use_cache=False,
                             **with_cache(cache)).logits  # fmt: skip
            first = head.logits[row_prompt][:, 0]  # position P - 1: the 1st completion token's
            return first, tail if on is not None else tail[:, :-1], col
    # logits_to_keep: the last width - start positions (HF's 0 would mean all of them)
    # use_cache=False: no key/value cache is built for a training forward
    with _output_rows(model, on):
        out = model(input_ids=ids, attention_mask=attn, logits_to_keep=width - start,
                    use_cache=False)  # fmt: skip
    return None, out.logits if on is not None else out.logits[:, :-1], -1


def _scatter(on: Tensor, flat: Tensor) -> Tensor:
    """(N,) values back to their (B, T) positions, 0 elsewhere; gradients flow to ``flat``."""
    return flat.new_zeros(on.shape).masked_scatter(on, flat)


def _entropy(rows: Tensor, temperature: float, grad: bool) -> Tensor:
    if grad:
        return row_entropy(rows, temperature)
    with torch.no_grad():
        return row_entropy(rows.detach(), temperature)


@contextmanager
def _output_rows(model: nn.Module, on: Tensor | None) -> Iterator[None]:
    """While the model runs, its output layer sees only the hidden states where ``on`` (B, T)
    is set, flattened to (N, H), so its logits come back (N, V); the layer's rows span one
    position more than ``on`` (the last predicts past the sequence) and it is never kept. A
    hook on the layer, not a second code path: DDP, FSDP2 and PEFT wrappers still run their
    own forward. ``on`` None: no hook."""
    if on is None:
        yield
        return
    keep = torch.cat([on, on.new_zeros(on.size(0), 1)], dim=1)
    inner = model.module if hasattr(model, "module") else model
    head = inner.get_output_embeddings()

    def pick(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        if hidden.shape[:2] != keep.shape:
            raise RuntimeError(
                f"output layer saw {tuple(hidden.shape)}, expected {tuple(keep.shape)}"
            )
        return (hidden[keep], *args[1:])

    handle = head.register_forward_pre_hook(pick)
    try:
        yield
    finally:
        handle.remove()
