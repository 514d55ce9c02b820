"""The learner's configuration: the ``[learner]`` table of an experiment's TOML file.

Loss options carry TRL's ``GRPOConfig`` names and meanings (``loss_type``, ``scale_rewards``,
``epsilon``, ``epsilon_high``, ``delta``, ``beta``, ``temperature``, ``max_completion_length``,
``use_bias_correction_kl``), so a TRL user's settings carry over; importance sampling against
the behaviour policy uses TRL's ``vllm_importance_sampling_*`` mode names without the ``vllm_``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal, cast

import msgspec

from streamrl import defaults as d
from streamrl.learner.losses import (
    IMPORTANCE_SAMPLING,
    LOSS_TYPES,
    SCALE_REWARDS,
    ImportanceSampling,
    LossConfig,
    LossType,
)
from streamrl.learner.report import targets


class LearnerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # -- model
    model: str  # a Hugging Face model directory (config, weights, tokenizer)
    output_dir: str = ""  # checkpoints/ and policy/ live here; "" → .streamrl/<run>/learner
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    # mixed precision: weights, gradients and AdamW stay in ``dtype``, the forward's matmuls run
    # in this type (torch.autocast); log-probs and the loss are taken in float32 either way.
    # bfloat16 pays on GPUs and on CPUs with AMX (~1.5x a SmolLM2 step on a 2-core Xeon);
    # dtype = "bfloat16" instead would round small AdamW updates away
    autocast: Literal["off", "bfloat16", "float16"] = "off"
    seed: int = 0
    torch_threads: int = 0  # CPU threads for torch; 0 leaves torch's default

    # -- LoRA (peft); lora_r = 0 trains the full model
    lora_r: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] | str = "all-linear"

    # -- batches
    batch_groups: int = 8  # groups per optimizer step
    micro_batch_size: int = 0  # sequences per forward/backward (gradient accumulation); 0 = all
    max_staleness: int = d.MAX_STALENESS  # drop groups more than this many versions old
    # a group's samples share their prompt: run it once per micro-batch, not once per sample
    # (logits.shifted_logits); false runs every sequence whole
    share_prompts: bool = True

    # -- loss (TRL names)
    loss_type: str = "dapo"  # grpo | dr_grpo | dapo | bnpo
    scale_rewards: str = "group"  # group | batch | none
    epsilon: float = 0.2  # ε_low
    epsilon_high: float | None = None  # ε_high; None → epsilon
    delta: float | None = None  # two-sided clip (INTELLECT-2); None = off
    clip_against: Literal["current", "behaviour"] = "current"
    importance_sampling: str = "token_truncate"  # off | token_truncate | token_mask | sequence_*
    importance_sampling_max: float | None = 2.0  # C (cap): TRL's vllm_importance_sampling_clip_max
    importance_sampling_min: float | None = None  # TRL's vllm_importance_sampling_clip_min
    beta: float = 0.0  # KL coefficient to the reference (initial) model; 0 = no reference model
    use_bias_correction_kl: bool = True
    temperature: float = 1.0  # the sampler's temperature: logits are divided by it
    # Entropy bonus: loss -= entropy_coef × mean token entropy. Against collapse to a
    # deterministic policy, whose groups all score alike and are dropped as zero-variance.
    entropy_coef: float = 0.0
    # Adaptive entropy control (losses.adapt_entropy_coef): with a target (nats per token) the
    # coefficient starts at entropy_coef and moves by entropy_coef_step per step, up while
    # the entropy is below the target, down (to 0) while above, never past entropy_coef_max.
    entropy_target: float | None = None
    entropy_coef_step: float = 0.01
    entropy_coef_max: float = 0.3
    max_completion_length: int = 512  # dr_grpo's constant normaliser

    # -- optimizer (AdamW) and schedule
    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 = no clipping
    warmup_steps: int = 0
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int = 0  # where linear/cosine decay reaches 0; also stops the learner (0 = never)

    # -- checkpoints and weight publishing
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    sync_every: int = 1
    keep_policy_versions: int = 3

    # -- training curves (TRL's names): "none" | "tensorboard" | "wandb" | "all", or a list;
    # the console's `step` and `published` lines every logging_steps steps (TRL's default 10;
    # the reporters get every step): no log line per batch in steady state
    report_to: str | list[str] = "none"
    logging_steps: int = 10

    # -- verdicts (learner.outcomes): zero-variance groups are solved (every sample at the top
    # reward: solved_reward, else the environment's max_reward) or have no signal (all alike
    # below it). stop_when_solved: stop (checkpoint, publish, exit 0 with a one-line verdict)
    # once this share of the last solved_window groups is solved (None: never stop);
    # no_signal_warn_groups: say so in one line after that many no-signal groups in a row
    # (0: never). The rates in the step log and `streamrl status` are over solved_window.
    stop_when_solved: float | None = None
    solved_window: int = 200
    solved_reward: float | None = None
    no_signal_warn_groups: int = 200

    # -- stream reading
    block_ms: int = d.READ_BLOCK_MS
    read_count: int = 64
    consumer: str = d.LEARNER_GROUP  # stable across restarts: its pending entries are ours

    # -- data parallel (torchrun): how long any collective may wait for a silent rank
    dist_timeout_s: float = d.DIST_TIMEOUT_S
    # how ranks hold the model under torchrun (one process ignores it): "none", a whole
    # replica per rank (DDP); "fsdp", each rank 1/N of the weights, gradients and AdamW state
    # (FSDP2, learner.sharded), for models whose training state does not fit one device
    sharding: Literal["none", "fsdp"] = "none"

    def __post_init__(self) -> None:
        checks = [
            (self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}"),
            (self.scale_rewards in SCALE_REWARDS, f"scale_rewards must be one of {SCALE_REWARDS}"),
            (
                self.importance_sampling in IMPORTANCE_SAMPLING,
                f"importance_sampling must be one of {IMPORTANCE_SAMPLING}",
            ),
            (
                self.clip_against == "current" or self.importance_sampling == "off",
                "clip_against='behaviour' already takes the ratio against the behaviour policy; "
                "set importance_sampling='off'",
            ),
            (self.batch_groups >= 1, "batch_groups must be >= 1"),
            (self.checkpoint_every >= 1, "checkpoint_every must be >= 1"),
            (self.sync_every >= 1, "sync_every must be >= 1"),
            (self.keep_checkpoints >= 1, "keep_checkpoints must be >= 1"),
            (self.keep_policy_versions >= 1, "keep_policy_versions must be >= 1"),
            (self.max_staleness >= 0, "max_staleness must be >= 0"),
            (0 < self.block_ms <= 5000, "block_ms must be in (0, 5000]"),
            (self.temperature > 0, "temperature must be > 0"),
            (self.entropy_coef >= 0, "entropy_coef must be >= 0"),
            (
                self.entropy_target is None or self.entropy_target > 0,
                "entropy_target must be > 0 (or left out)",
            ),
            (self.entropy_coef_step >= 0, "entropy_coef_step must be >= 0"),
            (self.entropy_coef_max >= 0, "entropy_coef_max must be >= 0"),
            (self.dist_timeout_s > self.block_ms / 1000, "dist_timeout_s must exceed block_ms"),
            (self.logging_steps >= 1, "logging_steps must be >= 1"),
            (
                self.stop_when_solved is None or 0 < self.stop_when_solved <= 1,
                "stop_when_solved must be in (0, 1] (or left out)",
            ),
            (self.solved_window >= 1, "solved_window must be >= 1"),
            (self.no_signal_warn_groups >= 0, "no_signal_warn_groups must be >= 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise msgspec.ValidationError(message)
        try:
            targets(self.report_to)
        except ValueError as e:
            raise msgspec.ValidationError(str(e)) from None

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    def loss_config(self) -> LossConfig:
        """The loss settings in ``losses.policy_loss``'s own names (validated above)."""
        return LossConfig(
            importance_sampling=cast(ImportanceSampling, self.importance_sampling),
            importance_sampling_max=self.importance_sampling_max,
            importance_sampling_min=self.importance_sampling_min,
            epsilon_low=self.epsilon,
            epsilon_high=self.eps_high,
            delta=self.delta,
            beta=self.beta,
            kl_bias_correction=self.use_bias_correction_kl,
            loss_type=cast(LossType, self.loss_type),
            max_completion_length=self.max_completion_length,
        )

    def out_dir(self, run: str) -> Path:
        return Path(self.output_dir) if self.output_dir else Path(d.RUN_DIR) / run / "learner"


def load_learner_config(path: str | Path, **overrides: object) -> LearnerConfig:
    """The ``[learner]`` table of a TOML experiment file; relative ``model`` and
    ``output_dir`` paths are kept as written (relative to the working directory)."""
    with open(path, "rb") as f:
        raw = tomllib.load(f)
    table = dict(raw.get("learner", {}))
    table.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return msgspec.convert(table, LearnerConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path} [learner]: {e}") from None
