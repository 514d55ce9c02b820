"""What the backends say about the policy they serve: ``version`` and ``reload_error``, and a
full-weight reload that needs no peft."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from streamrl.bus.keys import Keys
from streamrl.config import PolicyConfig
from streamrl.envs import make_env
from streamrl.learner import publish
from streamrl.models.tiny import build_model, build_tokenizer
from streamrl.policy import make_policy
from streamrl.policy.hf import HFPolicy
from streamrl.policy.openai import OpenAIPolicy
from streamrl.schema import PolicyVersion, encode
from tests.support.openai_server import OpenAITestServer

# Runs in a fresh interpreter where `import peft` fails, as it does where peft is not installed
# (None in sys.modules also makes importlib.util.find_spec, and so transformers, see no peft).
NO_PEFT_SCRIPT = textwrap.dedent(
    """
    import sys

    sys.modules["peft"] = None

    import asyncio, json
    from streamrl.config import PolicyConfig
    from streamrl.policy.hf import HFPolicy
    from streamrl.policy.base import PolicyRequest
    from streamrl.schema import Message, PolicyVersion, Task, encode
    from streamrl.bus.keys import Keys
    import redis

    model_dir, url, run, lora_dir = sys.argv[1:5]
    policy = HFPolicy(
        PolicyConfig(backend="hf", model=model_dir, max_new_tokens=6,
                     options={"device": "cpu", "dtype": "float32", "reload_check_s": 0}),
        None, redis_url=url, run=run,
    )
    task = Task(task_id="np:0", prompt_id="np", k=0, group_size=1, env="copy",
                input=[Message(role="user", content="copy : a b c")])

    async def main():
        await policy.refresh()
        turn = await policy.respond(PolicyRequest(task=task, items=list(task.input), tools=[]))
        loaded = {"version": policy.version, "error": policy.reload_error}
        # a LoRA version does need peft: it fails, visibly, and the full weights stay
        pv = PolicyVersion(version=2, path=lora_dir, format="lora")
        redis.Redis.from_url(url).xadd(Keys(run).policy, {"p": encode(pv)})
        await policy.refresh()
        lora = {"version": policy.version, "error": policy.reload_error}
        await policy.close()
        return turn, loaded, lora

    turn, loaded, lora = asyncio.run(main())
    try:
        import peft  # noqa: F401
        blocked = False
    except ImportError:
        blocked = True
    print(json.dumps({
        "loaded": loaded, "lora": lora, "peft_blocked": blocked,
        "turn_version": turn.policy_version, "prompt": turn.prompt_token_ids,
        "tokens": turn.token_ids, "logprobs": turn.logprobs,
    }))
    """
)


def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def test_full_weight_reload_works_without_peft(
    tiny_dir, r, redis_url, tmp_path, subprocess_env, run_name
):
    """The learner publishes full weights (v1); a backend in a process where peft cannot be
    imported loads them and samples from them. Only a LoRA version needs peft, and its
    failure shows as ``reload_error`` while the full weights keep serving."""
    trained = build_model(seed=1).eval()
    pv = publish.publish(
        r,
        Keys(run_name),
        trained,
        build_tokenizer(),
        tmp_path / "policy",
        version=1,
        step=1,
        lora=False,
        keep=3,
    )
    assert pv.format == "safetensors"
    lora_dir = tmp_path / "adapter"
    lora_dir.mkdir()
    out = subprocess.run(
        [sys.executable, "-c", NO_PEFT_SCRIPT, str(tiny_dir), redis_url, run_name, str(lora_dir)],
        capture_output=True,
        text=True,
        env=subprocess_env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["peft_blocked"]
    assert res["loaded"] == {"version": 1, "error": None}
    assert res["turn_version"] == 1
    expected = forward_logprobs(trained, res["prompt"], res["tokens"])
    assert res["logprobs"] == pytest.approx(expected, abs=1e-4)
    assert res["lora"]["version"] == 1
    assert "peft" in res["lora"]["error"]


def _announce(r, run: str, version: int, path, fmt: str = "safetensors") -> None:
    pv = PolicyVersion(version=version, step=version, path=str(path), format=fmt)
    r.xadd(Keys(run).policy, {"p": encode(pv)})


def test_hf_reports_the_last_reload_error_until_a_reload_succeeds(
    tiny_dir, r, redis_url, tmp_path, run_name
):
    policy = HFPolicy(
        PolicyConfig(backend="hf", model=str(tiny_dir), options={"reload_check_s": 0}),
        None,
        redis_url=redis_url,
        run=run_name,
    )
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"this is not a safetensors file")
    good = tmp_path / "good"
    good.mkdir()
    state = {k: v.contiguous() for k, v in build_model(seed=2).state_dict().items()}
    save_file(state, good / "model.safetensors")

    async def main():
        seen = []
        await policy.refresh()  # nothing announced: nothing to load, nothing wrong
        seen.append((policy.version, policy.reload_error))
        _announce(r, run_name, 3, bad)
        await policy.refresh()
        seen.append((policy.version, policy.reload_error))
        await policy.refresh()  # retried, still failing
        seen.append((policy.version, policy.reload_error))
        _announce(r, run_name, 4, good)
        await policy.refresh()
        seen.append((policy.version, policy.reload_error))
        await policy.close()
        return seen

    (v0, e0), (v1, e1), (v2, e2), (v3, e3) = asyncio.run(main())
    assert (v0, e0) == (0, None)
    assert v1 == 0 and e1 is not None and "SafetensorError" in e1
    assert v2 == 0 and e2 == e1
    assert (v3, e3) == (4, None)


def test_openai_reports_a_failed_server_update(tiny_dir, r, redis_url, tmp_path, run_name):
    good = tmp_path / "good"
    good.mkdir()
    state = {k: v.contiguous() for k, v in build_model(seed=1).state_dict().items()}
    save_file(state, good / "model.safetensors")
    with OpenAITestServer(tiny_dir) as server:
        policy = OpenAIPolicy(
            PolicyConfig(
                backend="openai",
                base_url=server.url + "/v1",
                model="tiny",
                options={
                    "sync": "weights",
                    "reload_check_s": 0,
                    "retries": 0,
                    "down_wait_s": 0,
                    "trust_env": False,
                },
            ),
            None,
            redis_url=redis_url,
            run=run_name,
        )

        async def main():
            seen = []
            _announce(r, run_name, 5, tmp_path / "missing")  # the server cannot read it
            await policy.refresh()
            seen.append((policy.version, policy.reload_error))
            _announce(r, run_name, 6, good)
            await policy.refresh()
            seen.append((policy.version, policy.reload_error))
            await policy.close()
            return seen

        (v1, e1), (v2, e2) = asyncio.run(main())
    assert v1 == 0 and e1 is not None and "collective_rpc" in e1
    assert (v2, e2) == (6, None)
    assert server.weights_version == 1


def test_scripted_policy_has_no_reload_to_fail():
    policy = make_policy(PolicyConfig(), make_env("copy"))
    asyncio.run(policy.refresh())
    assert (policy.version, policy.reload_error) == (0, None)
