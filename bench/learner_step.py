"""The learner's training step on a real model against TRL's: completion tokens trained per
second on the same fixed batch, SmolLM2-135M, float32, CPU.

    python bench/learner_step.py [--model models/smollm2-135m] [--threads 2] [--steps 3]
        [--groups 2] [--group-size 4] [--micro 4] [--modes full,lora] [--out FILE]

Only the training step is timed, never generation: forward, backward, gradient clipping and
the AdamW update over one batch of fixed, pre-sampled completions.

- The batch: ``--groups`` prompts (the model's chat template around a short arithmetic
  question, one per group) with ``--group-size`` completions each, of 16 to 96 tokens drawn
  from the vocabulary with a fixed seed (what the tokens say does not change the cost of a
  step), rewards 0/1 with a spread in every group.
- streamrl: ``learner.train.train_step`` (the learner's own step: ``make_batch`` layout,
  micro-batches of ``--micro`` sequences, prompt sharing) on ``load_model``'s model.
- TRL 1.16: a real ``GRPOTrainer`` whose generation returns the same batch, already scored (its
  ``_generate_and_score_completions`` is replaced by the dict it returned once, so that
  ``_prepare_inputs`` only shuffles and splits); one step is ``training_step`` (TRL's
  ``_compute_loss`` and ``accelerator.backward``) on each of its ``steps_per_generation``
  micro-batches, then ``clip_grad_norm_`` and its optimizer (``trainer.create_optimizer()``),
  as the Trainer's inner loop does.
- The same settings on both sides: ``loss_type="dapo"``, no importance sampling (no behaviour
  log-probs), β = 0, ε = 0.2, max_grad_norm 1, lr 1e-6, float32, micro-batch ``--micro``,
  ``torch.set_num_threads(--threads)``. Full fine-tuning and LoRA (r 16, α 32, all linear
  layers, peft). TRL twice: with its default ``gradient_checkpointing=True`` (activations
  recomputed in the backward pass) and without (the work streamrl's step does).
- The two run in one process, one step of each in turn (after one warm-up step each), so
  that a change in the machine's load falls on both alike. Figures: the median step's seconds
  and ``completion tokens / median seconds`` (the tokens that carry loss; the same count on
  both sides); also per CPU second of the process (``time.process_time``), steadier than wall
  time on a shared machine. Each step's times go to stderr as it ends.

Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "smollm2-135m"
LORA = {"r": 16, "alpha": 32}


def _data(tokenizer: Any, groups: int, k: int, seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)
    prompts, prompt_ids = [], []
    for _ in range(groups):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        messages = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number."}]
        prompts.append(messages)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        prompt_ids.append(list(ids["input_ids"]))
    specials = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in specials]
    completions, rewards = [], []
    for i in range(groups * k):
        n = rng.randint(16, 96)
        completions.append([rng.choice(vocab) for _ in range(n - 1)] + [tokenizer.eos_token_id])
        rewards.append(float(i % 2))  # every group has a spread
    return {"prompts": prompts, "prompt_ids": prompt_ids, "completions": completions,
            "rewards": rewards}  # fmt: skip


def _groups(data: dict, k: int) -> list:
    from streamrl.schema import Group, ModelTurn, Sample, Score, Trajectory

    out = []
    for g, prompt in enumerate(data["prompt_ids"]):
        samples = []
        for j in range(k):
            i = g * k + j
            turn = ModelTurn(index=0, items=[], prompt_token_ids=prompt,
                             token_ids=data["completions"][i], logprobs=[])  # fmt: skip
            traj = Trajectory(task_id=f"p{g}:{j}", prompt_id=f"p{g}", k=j, group_size=k,
                              env="bench", items=[], turns=[turn], status="completed")  # fmt: skip
            score = Score(task_id=f"p{g}:{j}", prompt_id=f"p{g}", k=j, reward=data["rewards"][i])
            samples.append(Sample(score=score, trajectory=traj))
        out.append(Group(1, f"p{g}", k, 0.0, 0.0, samples))
    return out


class StreamrlStep:
    def __init__(self, model_dir: Path, data: dict, args: argparse.Namespace, lora: bool):
        from streamrl.learner.batch import make_batch
        from streamrl.learner.config import LearnerConfig
        from streamrl.learner.model import load_model
        from streamrl.learner.train import make_optimizer

        self.cfg = LearnerConfig(
            model=str(model_dir), device="cpu", dtype="float32", loss_type="dapo",
            importance_sampling="off", micro_batch_size=args.micro, lr=1e-6,
            max_grad_norm=1.0, lora_r=LORA["r"] if lora else 0, lora_alpha=LORA["alpha"],
            share_prompts=not args.no_share_prompts,
        )  # fmt: skip
        self.model, tok, _ = load_model(self.cfg)
        self.optimizer = make_optimizer(self.model, self.cfg)
        self.batch = make_batch(_groups(data, args.group_size), tok.pad_token_id, "group")
        self.step_no = 0

    def step(self) -> tuple[float, float]:
        from streamrl.learner.train import train_step

        t0, c0 = time.perf_counter(), time.process_time()
        train_step(self.model, self.optimizer, self.batch, self.cfg, self.step_no)
        self.step_no += 1
        return time.perf_counter() - t0, time.process_time() - c0


class TrlStep:
    def __init__(
        self, model_dir: Path, data: dict, args: argparse.Namespace, lora: bool, out, ckpt: bool
    ):
        import datasets
        from trl import GRPOConfig, GRPOTrainer

        n = len(data["completions"])
        chunks = n // args.micro
        k = args.group_size

        def rollout(prompts, trainer):
            return {
                "prompt_ids": [data["prompt_ids"][i // k] for i in range(n)],
                "completion_ids": data["completions"],
                "logprobs": [[0.0] * len(c) for c in data["completions"]],  # unused: no IS
                "sample": list(range(n)),
            }

        def reward(completions, sample, **kwargs):
            return [data["rewards"][i] for i in sample]

        config = GRPOConfig(
            output_dir=str(out), per_device_train_batch_size=args.micro,
            gradient_accumulation_steps=chunks, num_generations=k, loss_type="dapo",
            max_completion_length=128, beta=0.0, epsilon=0.2, learning_rate=1e-6,
            max_grad_norm=1.0, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
            seed=0, model_init_kwargs={"dtype": "float32"}, gradient_checkpointing=ckpt,
        )  # fmt: skip
        peft_config = None
        if lora:
            from peft import LoraConfig

            peft_config = LoraConfig(
                r=LORA["r"], lora_alpha=LORA["alpha"], target_modules="all-linear",
                task_type="CAUSAL_LM",
            )  # fmt: skip
        from transformers import AutoTokenizer

        ds = datasets.Dataset.from_list([{"prompt": p} for p in data["prompts"] for _ in range(k)])
        self.trainer = t = GRPOTrainer(
            model=str(model_dir), reward_funcs=reward, args=config, train_dataset=ds,
            processing_class=AutoTokenizer.from_pretrained(model_dir), rollout_func=rollout,
            peft_config=peft_config,
        )  # fmt: skip
        self.inputs = [{"prompt": ds[i]["prompt"]} for i in range(n)]
        t.model.train()
        scored = t._generate_and_score_completions(self.inputs)  # once, outside the timing
        t._generate_and_score_completions = lambda batch: dict(scored)
        t.current_gradient_accumulation_steps = chunks
        t.create_optimizer()
        self.chunks = chunks
        self.params = [p for p in t.model.parameters() if p.requires_grad]

    def step(self) -> tuple[float, float]:
        t = self.trainer
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(self.chunks):
            t.training_step(t.model, self.inputs, None)
        torch.nn.utils.clip_grad_norm_(self.params, t.args.max_grad_norm)
        t.optimizer.step()
        t.model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0, time.process_time() - c0


def run_mode(mode: str, data: dict, args: argparse.Namespace, tmp: Path) -> dict:
    lora = mode == "lora"
    runners: dict[str, Any] = {"streamrl": StreamrlStep(args.model, data, args, lora)}
    # TRL's default recomputes activations in the backward pass (GRPOConfig's
    # gradient_checkpointing=True); without it, the same work as streamrl's step
    runners["trl"] = TrlStep(args.model, data, args, lora, tmp / mode, ckpt=True)
    runners["trl_no_checkpointing"] = TrlStep(args.model, data, args, lora, tmp / "nc", ckpt=False)
    srl = runners["streamrl"]
    times: dict[str, list[float]] = {name: [] for name in runners}
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    for i in range(args.steps + 1):  # step 0: warm-up, not counted
        for name, runner in runners.items():
            seconds, cpu_seconds = runner.step()
            print(f"{mode} step {i} {name}: {seconds:.2f} s ({cpu_seconds:.2f} s CPU)",
                  file=sys.stderr, flush=True)  # fmt: skip
            if i:
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
    tokens = int(srl.batch.num_tokens)
    b = srl.batch
    out: dict[str, Any] = {
        "completion_tokens_per_step": tokens,
        "sequences": b.num_sequences,
        "streamrl_padded_positions": int(b.input_ids.numel()),
    }
    for name, ts in times.items():
        med = statistics.median(ts)
        cpu_med = statistics.median(cpu[name])
        out[name] = {"step_s": [round(x, 3) for x in ts], "median_step_s": round(med, 3),
                     "tokens_per_s": round(tokens / med, 1),
                     "cpu_s": [round(x, 3) for x in cpu[name]],
                     "tokens_per_cpu_s": round(tokens / cpu_med, 2)}  # fmt: skip
    for name in ("trl", "trl_no_checkpointing"):
        ratio = out["streamrl"]["tokens_per_s"] / out[name]["tokens_per_s"]
        out[f"streamrl_over_{name}"] = round(ratio, 3)
    out["trl_optimizer"] = type(runners["trl"].trainer.optimizer).__name__
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (after 1 warm-up)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--micro", type=int, default=4, help="sequences per forward/backward")
    p.add_argument("--modes", default="full,lora")
    p.add_argument(
        "--no-share-prompts",
        action="store_true",
        help="streamrl with [learner] share_prompts = false (one forward per micro-batch)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import tempfile

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    data = _data(AutoTokenizer.from_pretrained(args.model), args.groups, args.group_size)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"{torch.get_num_threads()} torch threads".strip(),
        "torch": torch.__version__,
        "model": str(args.model.name),
        "streamrl_share_prompts": not args.no_share_prompts,
        "batch": {
            "groups": args.groups,
            "group_size": args.group_size,
            "micro": args.micro,
            "prompt_tokens": [len(x) for x in data["prompt_ids"]],
        },
    }
    import trl

    result["trl"] = trl.__version__
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes.split(","):
            result[mode] = run_mode(mode, data, args, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
