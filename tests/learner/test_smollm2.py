"""The learner takes steps on SmolLM2-135M-Instruct from configs/smollm2-copy.toml.

Opt-in (about a minute on 2 CPU cores, half of it turning the GGUF into a model directory):
``STREAMRL_SLOW=1 pytest tests/learner/test_smollm2.py``.
"""

from __future__ import annotations

import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from streamrl import schema
from streamrl.bus.keys import Keys
from streamrl.bus.streams import ensure_groups
from streamrl.envs.copy import SYMBOLS, CopyEnv
from streamrl.learner.config import load_learner_config
from streamrl.learner.loop import run_learner
from streamrl.learner.train import sequence_logps
from streamrl.schema import Group, Message, ModelTurn, Sample, Score, Task, Trajectory

pytestmark = pytest.mark.skipif(
    not os.environ.get("STREAMRL_SLOW"), reason="slow: set STREAMRL_SLOW=1"
)
ROOT = Path(__file__).resolve().parents[2]


def _groups(model_dir: Path, n: int, k: int) -> list[Group]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rng, env, groups = random.Random(0), CopyEnv(), []
    for i in range(n):
        prompt = env.generate(rng, i)
        messages = [{"role": "user", "content": prompt.input[0].content}]
        prompt_ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        samples = []
        for j in range(k):
            words = [
                a if rng.random() < 0.5 else rng.choice(SYMBOLS) for a in prompt.data["answer"]
            ]
            ids = tok(" ".join(words) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            seq = torch.tensor([list(prompt_ids) + ids])
            with torch.no_grad():
                lp = sequence_logps(model, seq, torch.ones_like(seq), 1.0)[0, -len(ids) :]
            text = tok.decode(ids, skip_special_tokens=False)
            task = Task(
                task_id=f"s{i}:{j}", prompt_id=f"s{i}", k=j, group_size=k, env="copy",
                input=prompt.input, data=prompt.data,
            )  # fmt: skip
            turn = ModelTurn(
                index=0, items=[Message(role="assistant", content=text)],
                prompt_token_ids=list(prompt_ids), token_ids=ids, logprobs=lp.tolist(),
            )  # fmt: skip
            traj = Trajectory(
                task_id=task.task_id, prompt_id=task.prompt_id, k=j, group_size=k, env="copy",
                items=[*prompt.input, *turn.items], turns=[turn], status="completed",
            )  # fmt: skip
            reward = env.verify(task, traj, env.reset(task)).reward
            score = Score(task_id=task.task_id, prompt_id=task.prompt_id, k=j, reward=reward)
            samples.append(Sample(score=score, trajectory=traj))
        groups.append(Group(schema.SCHEMA_VERSION, f"s{i}", k, 0.0, 0.0, samples))
    return groups


def test_learner_steps_on_smollm2(redis_url, r, tmp_path_factory, tmp_path):
    from streamrl.models.gguf import materialize_smollm2

    t0 = time.monotonic()
    model_dir = materialize_smollm2(tmp_path_factory.mktemp("smollm2") / "model")
    t_model = time.monotonic() - t0
    groups = _groups(model_dir, 12, 4)
    keys = Keys("smol")
    ensure_groups(r, keys)
    for g in groups:
        r.xadd(keys.groups, {"id": g.prompt_id, "p": schema.encode(g)})
    cfg = load_learner_config(
        ROOT / "configs" / "smollm2-copy.toml",
        model=str(model_dir),
        output_dir=str(tmp_path / "out"),
        device="cpu",
        total_steps=3,
    )
    import msgspec

    cfg = msgspec.structs.replace(cfg, batch_groups=2, checkpoint_every=3, lr=1e-5)
    t1 = time.monotonic()
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(state=run_learner(redis_url, "smol", cfg)))
    t.start()
    t.join(600)
    t_learn = time.monotonic() - t1
    state = box["state"]
    print(f"\nmaterialize {t_model:.1f}s, learner (load + 3 steps + 4 publishes) {t_learn:.1f}s")
    assert state.step == 3 and state.policy_version == 3
    assert (tmp_path / "out" / "policy" / "v3" / "model.safetensors").is_file()
