"""Signed policy versions: the learner announces the sha256 of every file it wrote, and the hf
backend loads the honest version but refuses a byte changed, a file truncated, removed or
added, keeping the weights it serves and saying why in ``reload_error``."""

from __future__ import annotations

import asyncio

import pytest
import torch

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig
from streamrl.learner import publish
from streamrl.models.tiny import build_model, build_tokenizer, save_tiny
from streamrl.policy.hf import HFPolicy
from streamrl.policy.integrity import PolicyIntegrityError, digest_dir, verify_dir
from streamrl.schema import POLICY_VERSION, PolicyVersion, encode


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def _publish(r, run: str, policy_dir, version: int, seed: int, lora: bool = False):
    return publish.publish(
        r, Keys(run), build_model(seed=seed).eval(), build_tokenizer(), policy_dir,
        version=version, step=version, lora=lora, keep=10,
    )  # fmt: skip


def _flip_byte(file, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


def _weight(policy: HFPolicy) -> torch.Tensor:
    return next(iter(policy._weights.model.state_dict().values())).clone()


def test_the_announcement_carries_a_digest_of_every_file(r, tmp_path, run_name):
    pv = _publish(r, run_name, tmp_path / "policy", 1, seed=1)
    announced = POLICY_VERSION.decode(r.xrevrange(Keys(run_name).policy, count=1)[0][1][b"p"])
    assert announced.digests == pv.digests == digest_dir(tmp_path / "policy" / "v1")
    assert "model.safetensors" in announced.digests
    assert all(len(d) == 64 for d in announced.digests.values())
    # an announcement from before the field decodes, with nothing to check
    assert POLICY_VERSION.decode(encode(PolicyVersion(version=3))).digests == {}


@pytest.mark.parametrize("damage", ["flip", "truncate", "remove", "add"])
def test_hf_refuses_a_damaged_version_and_keeps_serving_the_last_good_one(
    tiny_dir, r, redis_url, tmp_path, run_name, damage
):
    policy = HFPolicy(
        PolicyConfig(backend="hf", model=str(tiny_dir), options={"reload_check_s": 0}),
        None,
        redis_url=redis_url,
        run=run_name,
    )
    policy_dir = tmp_path / "policy"

    async def main():
        _publish(r, run_name, policy_dir, 1, seed=1)
        await policy.refresh()
        honest = (policy.version, policy.reload_error, _weight(policy))
        _publish(r, run_name, policy_dir, 2, seed=2)
        v2 = policy_dir / "v2"
        weights = v2 / "model.safetensors"
        if damage == "flip":
            _flip_byte(weights, weights.stat().st_size - 5)  # in the tensor data
        elif damage == "truncate":
            with weights.open("r+b") as f:
                f.truncate(weights.stat().st_size // 2)
        elif damage == "remove":
            (v2 / "tokenizer_config.json").unlink()
        else:
            (v2 / "model-00002.safetensors").write_bytes(b"extra")
        await policy.refresh()
        refused = (policy.version, policy.reload_error, _weight(policy))
        await policy.close()
        return honest, refused

    honest, refused = asyncio.run(main())
    assert honest[:2] == (1, None)
    assert refused[0] == 1 and torch.equal(refused[2], honest[2])  # v1's weights, untouched
    assert refused[1].startswith("PolicyIntegrityError: ")
    expected = {
        "flip": "tampered or truncated",
        "truncate": "tampered or truncated",
        "remove": "missing ['tokenizer_config.json']",
        "add": "not announced ['model-00002.safetensors']",
    }[damage]
    assert expected in refused[1]
    assert "\n" not in refused[1]


def test_a_lora_version_is_checked_too(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        build_model(seed=1), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    )
    model.save_pretrained(tmp_path / "v1")
    digests = digest_dir(tmp_path / "v1")
    assert set(digests) >= {"adapter_model.safetensors", "adapter_config.json"}
    read = verify_dir(tmp_path / "v1", digests, read=("adapter_model.safetensors",))
    assert (
        read["adapter_model.safetensors"]
        == (tmp_path / "v1/adapter_model.safetensors").read_bytes()
    )
    config = tmp_path / "v1" / "adapter_config.json"
    config.write_text(config.read_text().replace('"r": 2', '"r": 64'))
    with pytest.raises(PolicyIntegrityError, match=r"adapter_config\.json: sha256"):
        verify_dir(tmp_path / "v1", digests)
