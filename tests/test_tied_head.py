"""``models.tied_head``: a tied model's checkpoint gains an explicit ``lm_head.weight`` (what
vLLM's CPU reload needs to reach the head), and transformers loads it as before."""

from __future__ import annotations

import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from streamrl.models.tied_head import ties_head, write_explicit_head


def _config(**kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=2, **kw)  # fmt: skip


def _keys(directory) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_a_tied_checkpoint_gains_the_head_and_loads_the_same(tmp_path):
    torch.manual_seed(0)
    config = _config(tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    assert ties_head(tmp_path) and "lm_head.weight" not in _keys(tmp_path)
    assert write_explicit_head(tmp_path)
    assert "lm_head.weight" in _keys(tmp_path)
    assert not write_explicit_head(tmp_path)  # once
    again = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_an_untied_checkpoint_is_left_alone(tmp_path):
    config = _config(tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    assert not ties_head(tmp_path) and not write_explicit_head(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
