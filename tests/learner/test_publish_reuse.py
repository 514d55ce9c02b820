"""One learner's ``Publisher`` writes only the weights after its first version: the files that
never change are hard links to its previous version's, and what it announces still matches the
files on disk, across pruning."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.learner.publish import Publisher, publish
from streamrl.models.tiny import build_tokenizer
from streamrl.policy.integrity import digest_dir


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(build_tokenizer()), hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _announced(r, keys: Keys) -> list[int]:
    return [schema.POLICY_VERSION.decode(f[b"p"]).version for _, f in r.xrange(keys.policy)]


def test_later_versions_link_the_unchanging_files_and_announce_what_is_on_disk(tmp_path, r):
    model, tok, keys, out = _model(), build_tokenizer(), Keys("reuse"), tmp_path / "policy"
    pub = Publisher()
    inodes = lambda d: {p.name: p.stat().st_ino for p in d.iterdir()}  # noqa: E731
    for version in range(1, 6):
        with torch.no_grad():
            model.model.embed_tokens.weight.add_(0.25)  # a step: the weights change
        pv = pub.publish(r, keys, model, tok, out, version, version, lora=False, keep=2)
        assert pv is not None
        path = out / f"v{version}"
        assert pv.digests == digest_dir(path)  # what a worker checks
        again = LlamaForCausalLM.from_pretrained(path)
        assert torch.equal(again.model.embed_tokens.weight, model.model.embed_tokens.weight)
        if version == 1:
            continue
        assert sorted(p.name for p in out.iterdir()) == [f"v{version - 1}", f"v{version}"]
        now, before = inodes(path), inodes(out / f"v{version - 1}")
        assert set(now) == set(before) and "tokenizer.json" in now
        for name in now:  # the unchanging files are the previous version's, as links
            assert (now[name] == before[name]) == (name != "model.safetensors"), name
    assert _announced(r, keys) == [1, 2, 3, 4, 5]


def test_a_version_already_announced_is_not_announced_again(tmp_path, r):
    """A restarted learner replays its last steps and publishes their version again."""
    model, tok, keys, out = _model(), build_tokenizer(), Keys("again"), tmp_path / "policy"
    publish(r, keys, model, tok, out, 1, 1, lora=False, keep=3)
    publish(r, keys, model, tok, out, 2, 2, lora=False, keep=3)
    pub = Publisher()  # the restarted learner's
    assert pub.publish(r, keys, model, tok, out, 2, 2, lora=False, keep=3) is not None
    assert pub.publish(r, keys, model, tok, out, 3, 3, lora=False, keep=3) is not None
    assert _announced(r, keys) == [1, 2, 3]


def test_a_filesystem_without_hard_links_gets_every_file_written(tmp_path, r, monkeypatch):
    """Some network and FUSE filesystems refuse os.link: the version is written whole, and
    later ones do not try again."""
    import errno
    import os

    model, tok, keys, out = _model(), build_tokenizer(), Keys("nolinks"), tmp_path / "policy"
    tried = []

    def refuse(src, dst, *a, **kw):
        tried.append(dst)
        raise OSError(errno.EPERM, "Operation not permitted", str(dst))

    monkeypatch.setattr(os, "link", refuse)
    pub = Publisher()
    for version in (1, 2, 3):
        pv = pub.publish(r, keys, model, tok, out, version, version, lora=False, keep=3)
        assert pv is not None and pv.digests == digest_dir(out / f"v{version}")
        assert not list(out.glob(".tmp-*"))  # nothing half-made left behind
    assert len(tried) == 1  # v2 tried once, v3 did not
    assert all(p.stat().st_nlink == 1 for p in (out / "v2").iterdir())
    assert _announced(r, keys) == [1, 2, 3]
