"""TRL's agent training on ``lookup``: GRPOTrainer in its multi-turn tool mode
(``environment_factory``), in one process on the CPU, matched to ``configs/smollm2-lookup.toml``.

    python -m streamrl.benchmarks.trl_agent --model models/smollm2-135m --snapshots DIR \
        [--lr 1e-4] [--seconds 600] [--threads 2] [--seed 0]

What is matched, and how (``streamrl bench vs-trl --task lookup`` runs it):

- **Task and reward.** The dataset rows are ``LookupEnv(split="train").generate`` prompts (the
  worked example, then the question); ``LookupTools`` puts the environment itself behind TRL's
  tool methods, so a lookup answers exactly what streamrl's episode answers, and
  ``get_reward`` is the environment's own ``verify`` on the final state.
- **Prompt text.** SmolLM2's chat template knows nothing of tools, and TRL refuses it
  ("The provided chat template does not support tool calling"). ``TOOL_TEMPLATE`` is that
  template plus what streamrl's ``hf`` backend does for it (policy option ``tool_prompt``):
  the tools described in the system message in the same words, calls written inline as
  ``<tool_call>{...}</tool_call>``; the rendered prompt is the same text (tested). Replies are
  parsed with TRL's own Hermes parser (``qwen3_template``: SmolLM2 is ChatML as well).
- **Shape and budgets.** 2 prompts x 8 samples per step, temperature 0.7, at most 3 model
  turns (``max_tool_calling_iterations = 2``) of at most 36 sampled tokens each
  (``generation_kwargs``); TRL's budget for the whole multi-turn completion
  (``max_completion_length``) is 3 x 36 plus the two tool answers' tokens.
- **Precision.** float32; with ``--bf16`` (``bench vs-trl`` passes it when streamrl's config
  sets ``learner.autocast = "bfloat16"``) accelerate's bfloat16 autocast over float32 weights,
  which covers TRL's generation too, as streamrl's ``policy.options.dtype = "bfloat16"`` does.
- **Loss and optimizer.** ``dapo``, group-scaled rewards, epsilon 0.2 / 0.28, beta 0; the
  learner's own AdamW and schedule (``make_optimizer``, ``lr_at``: 3 warm-up steps at lr/3,
  2lr/3, then lr), gradient norm clipped at 1.

Differences TRL's API leaves: a tool cannot end the episode, so after ``submit`` the model gets
its remaining turns (calls after ``submit`` change nothing); a reply whose tool call does not
parse is plain text to TRL and ends the episode (streamrl hands it to the environment, whose
error the model reads); a tool error is TRL's ``{'error': ...}`` text.

Every ``--snapshot-every`` seconds of training it saves the weights (``model.safetensors``,
what ``streamrl eval --weights`` loads) and records when, with the time spent saving taken
off the clock; it stops at ``--seconds``, or once the mean training reward of the last
``--stop-window`` steps reaches ``--stop-reward``. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

from streamrl.envs.base import ToolError
from streamrl.envs.lookup import LookupEnv
from streamrl.schema import Task

# SmolLM2's ChatML, plus tools the way streamrl's hf backend renders them for a template that
# cannot take them (streamrl.policy._chat: tool_prompt, with_system, hermes_call)
TOOL_TEMPLATE = (
    "{%- set ns = namespace(tp='You can call tools. Tools:', c='') -%}"
    "{%- for t in tools or [] -%}{%- set f = t.function if t.function is defined else t -%}"
    "{%- set ns.tp = ns.tp + '\\n- ' + f.name + '('"
    " + (f.parameters.properties.keys() | join(', ')) + ')'"
    " + ((': ' + f.description) if f.description else '') -%}{%- endfor -%}"
    "{%- set ns.tp = ns.tp + '\\nTo call a tool, write only: "
    '<tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>\' -%}'
    "{%- for message in messages -%}"
    "{%- set ns.c = message.content if message.content is string else '' -%}"
    "{%- if loop.first and message.role != 'system' -%}"
    "{%- if tools -%}{{ '<|im_start|>system\\n' + ns.tp + '<|im_end|>\\n' }}"
    "{%- else -%}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, "
    "trained by Hugging Face<|im_end|>\\n' }}{%- endif -%}"
    "{%- elif loop.first and tools -%}{%- set ns.c = (ns.tp + '\\n' + ns.c).rstrip() -%}"
    "{%- endif -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- set ns.c = ns.c + '<tool_call>'"
    " + ({'name': fn.name, 'arguments': fn.arguments} | tojson) + '</tool_call>' -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_start|>' + message.role + '\\n' + ns.c + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


class LookupTools:
    """``lookup`` as a TRL environment: ``reset`` takes a dataset row, the public methods are
    the tools (TRL reads their schema from the signature and docstring), ``get_reward`` is
    the environment's verifier on the final state."""

    def __init__(self, split: str = "train") -> None:
        self._env = LookupEnv(split=split)
        self._task: Task | None = None
        self._state: Any = None

    def reset(self, directory: str = "{}", target: str = "", **_: Any) -> None:
        data = {"target": target, "directory": json.loads(directory)}
        self._task = Task(task_id="trl:0", prompt_id="trl", k=0, group_size=1, env="lookup",
                          input=[], data=data)  # fmt: skip
        self._state = self._env.reset(self._task)

    def _call(self, name: str, arguments: dict) -> str:
        if self._state.submitted is not None:  # streamrl's episode ended at the submit
            raise ToolError("the code was already submitted")
        res = self._env.step(self._state, name, arguments)
        self._state = res.state
        return res.output

    def lookup(self, name: str) -> str:
        """returns the secret code of a person

        Args:
            name: the person's name
        """
        return self._call("lookup", {"name": name})

    def submit(self, code: int) -> str:
        """submits a code

        Args:
            code: the code
        """
        return self._call("submit", {"code": code})

    def get_reward(self) -> float:
        # lookup's verdict reads the task and the final state only, not the trajectory
        return self._env.verify(self._task, None, self._state).reward  # type: ignore[arg-type]


def rows(n: int, seed: int) -> list[dict]:
    """``n`` training prompts as TRL dataset rows (the directory as JSON: its keys differ)."""
    from streamrl.policy._chat import to_messages

    env, rng = LookupEnv(split="train"), random.Random(seed)
    out = []
    for i in range(n):
        p = env.generate(rng, i)
        row = {"directory": json.dumps(p.data["directory"]), "target": p.data["target"]}
        # the worked example's calls written into the assistant's text, as the hf backend
        # writes them: as tool_calls, datasets' Arrow columns would give every call's arguments
        # every argument name of every call (lookup {"name": "Ana", "code": null}), and the
        # model would learn from that example to call lookup with a code
        out.append({"prompt": to_messages(p.input, inline_tool_calls=True), **row})
    return out


def tool_tokenizer(model: str | Any) -> Any:
    """SmolLM2's tokenizer (a directory, or a tokenizer) with ``TOOL_TEMPLATE`` and TRL's
    Hermes reply parser."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_template

    tok = AutoTokenizer.from_pretrained(model) if isinstance(model, str) else model
    tok.chat_template = TOOL_TEMPLATE
    tok.response_template = qwen3_template
    return tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--snapshots", type=Path, required=True)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--snapshot-every", type=float, default=60.0)
    ap.add_argument("--stop-reward", type=float, default=2.0)
    ap.add_argument("--stop-window", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bf16", action="store_true", help="bfloat16 autocast (learner.autocast)")
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=36)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--template-check", action="store_true", help="show SmolLM2's own error")
    args = ap.parse_args()

    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch

    torch.set_num_threads(args.threads)
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = tool_tokenizer(args.model)
    if args.template_check:  # TRL on SmolLM2's own chat template
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
    # the two tool answers' tokens, which TRL counts in the completion's budget
    answers = len(tok('{"name": "Mira", "code": 1234}submitted')["input_ids"]) + 2 * 8
    args.snapshots.mkdir(parents=True, exist_ok=True)
    result: dict = {"lr": args.lr, "seed": args.seed, "threads": args.threads, "snapshots": []}
    rewards: list[float] = []
    zero_std: list[float] = []
    off_clock = [0.0]  # seconds spent saving snapshots, not training

    class Watch(TrainerCallback):
        last = [0.0]

        def on_step_begin(self, a, state, control, **kw):
            if "t0" not in result:
                result["t0"] = time.perf_counter()
                result["first_step_at"] = time.time()
                self.last[0] = result["t0"]

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(float(logs["reward"]))
                # groups whose 8 rewards are all equal: no advantage, no gradient
                zero_std.append(float(logs.get("frac_reward_zero_std", float("nan"))))
                with open(args.snapshots / "steps.jsonl", "a") as f:  # read if the run is cut off
                    f.write(json.dumps({"step": state.global_step, "reward": rewards[-1],
                                        "frac_reward_zero_std": zero_std[-1]}) + "\n")  # fmt: skip
                recent = rewards[-args.stop_window :]
                if (
                    len(recent) == args.stop_window
                    and sum(recent) / len(recent) >= args.stop_reward
                ):
                    control.should_training_stop = True
                if time.perf_counter() - result["t0"] - off_clock[0] >= args.seconds:
                    control.should_training_stop = True

        def on_step_end(self, a, state, control, model=None, **kw):
            now = time.perf_counter()
            if now - self.last[0] < args.snapshot_every and not control.should_training_stop:
                return
            at = time.time() - off_clock[0]  # the moment, less earlier saves
            path = args.snapshots / f"s{state.global_step}"
            model.save_pretrained(path, safe_serialization=True)
            snap = {"step": state.global_step, "at": at, "path": str(path)}
            result["snapshots"].append(snap)
            with open(args.snapshots / "index.jsonl", "a") as f:  # read if the run is cut off
                f.write(json.dumps(snap) + "\n")
            off_clock[0] += time.perf_counter() - now
            self.last[0] = time.perf_counter()

    config = GRPOConfig(
        output_dir=str(args.snapshots / "out"),
        # 2 prompts x 8 samples a step ([learner] batch_groups = 2), trained 8 rows at a time
        # ([learner] micro_batch_size = 8 in the bench): 16 rows at once need ~8 GB
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        generation_batch_size=16,
        num_generations=8,
        max_completion_length=args.max_turns * args.max_new_tokens + answers,
        max_tool_calling_iterations=args.max_turns - 1,
        generation_kwargs={"max_new_tokens": args.max_new_tokens},  # per turn, as streamrl's
        temperature=args.temperature,
        learning_rate=args.lr,
        # the schedule is streamrl's (below): transformers' constant_with_warmup starts at 0, so
        # TRL's first step would not move the weights at all where streamrl's moves them by lr/3
        max_grad_norm=1.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
        max_steps=10_000,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=args.bf16,  # accelerate's autocast: training forward and generation alike
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=True,
        gradient_checkpointing=False,  # on by default in TRL; memory is not short here
    )
    from transformers import AutoModelForCausalLM

    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.train import lr_at, make_optimizer

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    matched = LearnerConfig(model=args.model, lr=args.lr, warmup_steps=3)
    optimizer = make_optimizer(model, matched)  # AdamW, the learner's betas, eps, decay
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, matched) / args.lr
    )
    trainer = GRPOTrainer(
        model=model,
        optimizers=(optimizer, schedule),
        args=config,
        train_dataset=datasets.Dataset.from_list(rows(20_000, args.seed)),
        processing_class=tok,
        environment_factory=LookupTools,
        callbacks=[Watch()],
    )
    trainer.train()
    result["steps"] = trainer.state.global_step
    result["seconds"] = round(time.perf_counter() - result.pop("t0") - off_clock[0], 2)
    result["snapshot_seconds"] = round(off_clock[0], 2)
    result["rewards"] = [round(r, 4) for r in rewards]
    result["frac_reward_zero_std"] = [round(z, 3) for z in zero_std]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
