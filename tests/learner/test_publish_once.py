"""A full model's policy version is serialized once (``publish._save_full``): the same files,
names, tensors and config as ``save_pretrained`` + ``write_explicit_head`` wrote, and the
announced digests those of the files on disk."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM

from streamrl.bus.keys import Keys
from streamrl.learner.publish import publish
from streamrl.models.tied_head import write_explicit_head
from streamrl.models.tiny import build_tokenizer
from streamrl.policy.integrity import digest_dir


def _tensors(directory) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)


@pytest.mark.parametrize("tied", [True, False])
def test_one_pass_writes_what_save_pretrained_and_the_explicit_head_wrote(tmp_path, r, tied):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(build_tokenizer()), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         tie_word_embeddings=tied)  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # trained a little: the head's copy must follow the embedding
        model.model.embed_tokens.weight.add_(0.5)
    tok = build_tokenizer()
    ref = tmp_path / "ref"
    model.save_pretrained(ref, max_shard_size="1000GB")
    write_explicit_head(ref)
    tok.save_pretrained(ref)

    pv = publish(r, Keys("pub"), model, tok, tmp_path / "policy", 1, 1, lora=False, keep=3)
    assert pv is not None
    mine = tmp_path / "policy" / "v1"
    assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in ref.iterdir())
    a, b = _tensors(mine), _tensors(ref)
    assert a.keys() == b.keys() and ("lm_head.weight" in a)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    if tied:
        assert torch.equal(a["lm_head.weight"], a["model.embed_tokens.weight"])
    assert json.loads((mine / "config.json").read_text()) == json.loads(
        (ref / "config.json").read_text()
    )
    assert pv.digests == digest_dir(mine)  # what a worker checks
    again = LlamaForCausalLM.from_pretrained(mine).eval()
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model.eval()(ids).logits)
