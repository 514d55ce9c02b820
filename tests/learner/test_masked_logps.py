"""The learner's output layer runs only where there is loss (logits.masked_logps): on rows with
holes in their loss mask (a multi-turn episode's tool outputs) and padding, its log-probs,
entropies and gradients must be those of computing every position's logits, and the output
layer must really see only the masked positions."""

from __future__ import annotations

import pytest
import torch

from streamrl.learner.logits import masked_logps, sequence_logps
from streamrl.learner.losses import token_entropy


def _rows(seed: int, shared: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list]:
    """4 rows of 14 tokens: a 5-token prompt (the same one in every row when ``shared``), then
    turns with loss, a 'tool output' without loss between them, and right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 24, (4, 14), generator=g)
    if shared:
        ids[:, :5] = ids[0, :5]
    attn = torch.ones_like(ids)
    attn[1, 11:] = 0  # padding
    attn[3, 9:] = 0
    mask = torch.zeros(4, 13)  # shifted: column t is the loss of token t + 1
    mask[:, 4:7] = 1  # the first turn
    mask[:, 9:12] = 1  # the second, after a 2-token tool output
    mask[1, 10:] = 0
    mask[3, 8:] = 0
    return ids, attn, mask, [5, 5, 5, 5]


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("start", [0, 4])
def test_logps_entropy_and_gradients_match_full_logits(tiny_dir, shared, start):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.train()
    ids, attn, mask, prompt_lens = _rows(7, shared)
    mask = mask[:, start:]
    on = mask.bool()

    rows_seen: list[int] = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, args, out: rows_seen.append(out.shape[0]))
    model.zero_grad(set_to_none=True)
    logps, ent = masked_logps(model, ids, attn, mask, 0.7, prompt_lens if shared else None,
                              start, entropy_grad=True)  # fmt: skip
    ((logps * mask).sum() + ent.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    hook.remove()
    # the layer saw the masked positions only, flat: N rows of logits, N the mask's count
    # (shared: the one distinct prompt's last position, then the masked positions after it)
    if shared:
        assert rows_seen == [1, int(on[:, 5 - start :].sum())]
    else:
        assert rows_seen == [int(on.sum())]

    model.zero_grad(set_to_none=True)
    full = model(input_ids=ids, attention_mask=attn).logits[:, start:-1]
    want = sequence_logps(model, ids, attn, 0.7, None, start)
    want_ent = token_entropy(full, mask, 0.7)
    ((want * mask).sum() + want_ent.sum()).backward()

    torch.testing.assert_close(logps[on], want[on], atol=1e-5, rtol=1e-5)
    assert bool((logps[~on] == 0).all())
    torch.testing.assert_close(ent, want_ent, atol=1e-5, rtol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
