"""Groups for learner tests, made from the tiny model and scored by the real copy verifier."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import torch

from streamrl import schema
from streamrl.envs.copy import SYMBOLS, CopyEnv
from streamrl.models.tiny import build_tokenizer
from streamrl.schema import Group, Message, ModelTurn, Sample, Score, Task, Trajectory


def make_groups(
    model_dir: Path,
    n: int,
    seed: int = 0,
    group_size: int = 4,
    versions: list[int] | None = None,
) -> list[Group]:
    """``n`` copy-task groups: completions that copy each symbol with probability 1/2 (so
    rewards vary and some groups have none), scored by the real ``copy`` verifier, with the
    tiny model's own log-probs (plus noise) as behaviour log-probs."""
    from transformers import AutoModelForCausalLM

    from streamrl.learner.train import sequence_logps

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    env = CopyEnv()
    groups = []
    for i in range(n):
        prompt = env.generate(rng, i)
        answer = prompt.data["answer"]
        prompt_ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt.input[0].content}],
            add_generation_prompt=True,
            return_dict=True,
        )["input_ids"]
        version = versions[i] if versions else 0
        samples = []
        for k in range(group_size):
            words = [a if rng.random() < 0.5 else rng.choice(SYMBOLS) for a in answer]
            words = words[: rng.randint(1, 3)] if rng.random() < 0.2 else words
            ids = tok.convert_tokens_to_ids([*words, "<eos>"])
            seq = torch.tensor([list(prompt_ids) + ids])
            with torch.no_grad():
                lp = sequence_logps(model, seq, torch.ones_like(seq), 1.0)[0, -len(ids) :]
            lp = lp + 0.1 * torch.randn(len(ids), generator=gen)
            text = tok.decode(ids, skip_special_tokens=False)
            task = Task(
                task_id=f"g{i}:{k}", prompt_id=f"g{i}", k=k, group_size=group_size,
                env="copy", input=prompt.input, data=prompt.data,
            )  # fmt: skip
            turn = ModelTurn(
                index=0,
                items=[Message(role="assistant", content=text)],
                prompt_token_ids=list(prompt_ids),
                token_ids=ids,
                logprobs=lp.tolist(),
                policy_version=version,
            )
            traj = Trajectory(
                task_id=task.task_id, prompt_id=task.prompt_id, k=k, group_size=group_size,
                env="copy", items=[*prompt.input, *turn.items], turns=[turn],
                status="completed",
            )  # fmt: skip
            verdict = env.verify(task, traj, env.reset(task))
            score = Score(
                task_id=task.task_id, prompt_id=task.prompt_id, k=k, reward=verdict.reward
            )
            samples.append(Sample(score=score, trajectory=traj))
        rewards = [s.score.reward for s in samples]
        mean = sum(rewards) / len(rewards)
        std = (sum((x - mean) ** 2 for x in rewards) / len(rewards)) ** 0.5
        groups.append(Group(schema.SCHEMA_VERSION, f"g{i}", group_size, mean, std, samples))
    return groups


def feed(r, keys, groups: list[Group]) -> list[str]:
    """XADD groups the way the group-assembly script does: fields ``id`` and ``p``."""
    return [
        r.xadd(keys.groups, {"id": g.prompt_id, "p": schema.encode(g)}).decode() for g in groups
    ]


def run_learner_thread(url: str, run: str, cfg, **kw):
    """``run_learner`` on a thread (it installs signal handlers only on the main thread); its
    final state."""
    from streamrl.learner.loop import run_learner

    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(state=run_learner(url, run, cfg, **kw)), daemon=True
    )
    t.start()
    t.join(120)
    assert not t.is_alive(), "the learner did not stop within 120 s"
    return box["state"]
