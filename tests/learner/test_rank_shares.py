"""How the data-parallel learner cuts a batch over ranks: every sequence on exactly one rank,
as many backward passes on every rank, and per-rank losses that add up to the one-process
loss and gradient for every loss type whose normaliser is the whole batch."""

from __future__ import annotations

import pytest
import torch
from groupdata import make_groups
from transformers import AutoModelForCausalLM

from streamrl.learner.batch import make_batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.distributed import num_chunks, rank_chunks
from streamrl.learner.train import batch_loss, chunk_loss
from streamrl.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def batch(tiny_dir):
    return make_batch(make_groups(tiny_dir, 3, seed=4), build_tokenizer().pad_token_id, "group")


@pytest.mark.parametrize("world", [1, 2, 3, 5, 16])
@pytest.mark.parametrize("micro", [0, 1, 3])
def test_every_row_on_one_rank_and_equal_passes(batch, world, micro):
    per_rank = [rank_chunks(batch, micro, r, world) for r in range(world)]
    rows = [i for chunks in per_rank for s in chunks for i in range(s.start, s.stop)]
    assert rows == list(range(batch.num_sequences))
    assert len({len(chunks) for chunks in per_rank}) == 1  # DDP syncs on every rank's last
    if micro:
        assert all(s.stop - s.start <= micro for chunks in per_rank for s in chunks)
    assert num_chunks(batch, micro, world) == sum(
        1 for chunks in per_rank for s in chunks if s.stop > s.start
    )


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_rank_losses_sum_to_the_batch_loss(tiny_dir, batch, loss_type):
    cfg = LearnerConfig(model=str(tiny_dir), loss_type=loss_type, micro_batch_size=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    whole = batch_loss(model, batch, cfg)
    expected = _grads(model)
    world, total, chunks_total = 3, 0.0, num_chunks(batch, 2, 3)
    for rank in range(world):
        for rows in rank_chunks(batch, 2, rank, world):
            if rows.stop > rows.start:
                part = chunk_loss(model, batch, rows, cfg, None, chunks_total)
                part.value.backward()
                total += float(part.value.detach())
    got = _grads(model)
    assert total == pytest.approx(whole.loss, abs=1e-6)
    assert got.keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, atol=1e-6, rtol=1e-5, msg=name)
