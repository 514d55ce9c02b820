"""streamrl's GRPO loss agrees with TRL 1.16's ``GRPOTrainer._compute_loss``.

TRL side: a real ``GRPOTrainer`` on the tiny model (CPU, no vLLM). Its documented
``rollout_func`` hook hands TRL a fixed, hand-made generation batch (prompt ids, completion
ids, behaviour log-probs) instead of sampling; TRL's own ``_generate_and_score_completions``
then computes rewards (through a real reward function), advantages, π_old, the importance
sampling ratios and ``num_items_in_batch``, and ``_compute_loss`` the loss. For importance
correction the trainer's ``use_vllm`` flag is switched on after construction (vLLM itself is
never started: with ``rollout_func`` nothing calls it), so that TRL applies its
``vllm_importance_sampling_*`` correction to the batch's behaviour log-probs, exactly the path
vLLM log-probs take.

streamrl side: the same data as ``Group``s → ``make_batch`` → ``batch_loss`` (the learner's
own code path) on an independent copy of the model. Loss values and every parameter's
gradient must agree to ~1e-5.

What is matched, and how:
- every shared ``loss_type`` (grpo, dr_grpo, dapo, bnpo) with importance sampling off and on
  (token_truncate, token_mask, sequence_truncate, sequence_mask), all ``scale_rewards``, a
  sampling temperature, and micro-batching (streamrl's ``micro_batch_size`` against TRL's
  gradient accumulation: ``_compute_loss`` per micro-batch with
  ``current_gradient_accumulation_steps`` and ``steps_per_generation`` set to the number of
  micro-batches; the micro-batches must be of equal size for grpo/dr_grpo to coincide).
- clipping (ε_low, ε_high, δ) and the KL term (β, k3, ``use_bias_correction_kl``) need
  π_θ ≠ π_old, which never happens inside one learner step (π_old is the detached model,
  TRL's ``num_iterations=1``). They are checked on ``losses.policy_loss`` directly, fed with
  TRL's own π_old / behaviour / reference log-probs and advantages after the policy weights
  were moved.

Not reproduced: π_old. TRL computes π_old (used in its IS ratio) in a separate no-grad forward
when vLLM IS is on; streamrl uses the detached log-probs of the training forward. Both are
the same weights on the same tokens, so this agrees to float rounding (well inside 1e-5), but
is not bitwise. TRL options streamrl does not implement: ``importance_sampling_level=
"sequence"`` (GSPO), the cispo/sapo/luspo/vespo losses, ``off_policy_mask_threshold``,
``top_entropy_quantile``, entropy bonus, ``num_iterations > 1``.
"""

from __future__ import annotations

import os

import pytest
import torch

from streamrl.learner import losses
from streamrl.learner.batch import make_batch
from streamrl.learner.config import LearnerConfig
from streamrl.learner.train import batch_loss, sequence_logps
from streamrl.models.tiny import build_tokenizer, save_tiny
from streamrl.schema import Group, ModelTurn, Sample, Score, Trajectory

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

G, K = 3, 4  # groups, samples per group
MAX_COMPLETION = 8
ATOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def data(model_dir):
    """A fixed generation batch: prompts, completions of 1..6 tokens, rewards, and behaviour
    log-probs = the model's own log-probs plus noise (ratios both sides of the caps)."""
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer()
    gen = torch.Generator().manual_seed(0)
    letters = "abcdefghijklmnop"
    prompts, prompt_ids = [], []
    for _ in range(G):
        idx = torch.randint(0, 16, (3,), generator=gen).tolist()
        messages = [{"role": "user", "content": "copy : " + " ".join(letters[i] for i in idx)}]
        prompts.append(messages)
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
        prompt_ids.append(list(ids["input_ids"]))
    completions = []
    for i in range(G * K):
        n = 1 + i % 6
        ids = torch.randint(6, 22, (n,), generator=gen).tolist()
        if i % 3 == 0:
            ids[-1] = tok.eos_token_id
        completions.append(ids)
    rewards = [round(float(x), 3) for x in torch.rand(G * K, generator=gen)]
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    behaviour = []
    with torch.no_grad():
        for i, comp in enumerate(completions):
            ids = torch.tensor([prompt_ids[i // K] + comp])
            lp = sequence_logps(model, ids, torch.ones_like(ids), 1.0)[0, -len(comp) :]
            noise = 0.6 * torch.randn(len(comp), generator=gen)
            behaviour.append((lp + noise).tolist())
    return {
        "prompts": prompts,
        "prompt_ids": prompt_ids,
        "completions": completions,
        "rewards": rewards,
        "behaviour": behaviour,
    }


def _groups(data) -> list[Group]:
    groups = []
    for g in range(G):
        samples = []
        for k in range(K):
            i = g * K + k
            turn = ModelTurn(
                index=0,
                items=[],
                prompt_token_ids=data["prompt_ids"][g],
                token_ids=data["completions"][i],
                logprobs=data["behaviour"][i],
            )
            traj = Trajectory(
                task_id=f"p{g}:{k}", prompt_id=f"p{g}", k=k, group_size=K, env="copy",
                items=[], turns=[turn], status="completed",
            )  # fmt: skip
            score = Score(task_id=f"p{g}:{k}", prompt_id=f"p{g}", k=k, reward=data["rewards"][i])
            samples.append(Sample(score=score, trajectory=traj))
        groups.append(Group(1, f"p{g}", K, 0.0, 0.0, samples))
    return groups


def _trl_trainer(model_dir, data, tmp_path, **options):
    from trl import GRPOConfig, GRPOTrainer

    def rollout(prompts, trainer):
        assert len(prompts) == G * K
        return {
            "prompt_ids": [data["prompt_ids"][i // K] for i in range(G * K)],
            "completion_ids": data["completions"],
            "logprobs": data["behaviour"],
            "sample": list(range(G * K)),
        }

    def reward(completions, sample, **kwargs):
        return [data["rewards"][i] for i in sample]

    is_mode = options.pop("importance_sampling", "off")
    is_options = {}
    if is_mode != "off":
        is_options = {
            "vllm_importance_sampling_mode": is_mode,
            "vllm_importance_sampling_clip_max": options.pop("importance_sampling_max", 2.0),
            "vllm_importance_sampling_clip_min": options.pop("importance_sampling_min", None),
        }
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=G * K,
        num_generations=K,
        max_completion_length=MAX_COMPLETION,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        **is_options,
        **options,
    )
    ds = datasets.Dataset.from_list([{"prompt": p} for p in data["prompts"]])
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=reward,
        args=args,
        train_dataset=ds,
        processing_class=build_tokenizer(),
        rollout_func=rollout,
    )
    if is_mode != "off":
        trainer.use_vllm = True  # apply TRL's vLLM IS correction to the rollout's logprobs
        trainer._last_loaded_step = trainer.state.global_step  # no weight sync to a server
    trainer.vllm_importance_sampling_correction = is_mode != "off"
    trainer.model.train()
    return trainer


def _trl_loss(trainer, chunks: int = 1):
    """TRL's loss and gradients on the batch, split into ``chunks`` accumulation steps."""
    out = trainer._generate_and_score_completions(
        [{"prompt": trainer.train_dataset[i // K]["prompt"]} for i in range(G * K)]
    )
    trainer.current_gradient_accumulation_steps = chunks
    trainer.args.steps_per_generation = chunks
    trainer.model.zero_grad(set_to_none=True)
    size = G * K // chunks
    total = 0.0
    for c in range(chunks):
        part = {
            k: v[c * size : (c + 1) * size] if torch.is_tensor(v) and v.dim() > 0 else v
            for k, v in out.items()
        }
        loss = trainer._compute_loss(trainer.model, part)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    return total, grads, out


def _streamrl_loss(model_dir, data, cfg: LearnerConfig):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).train()
    batch = make_batch(_groups(data), build_tokenizer().pad_token_id, cfg.scale_rewards)
    loss = batch_loss(model, batch, cfg).loss
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(trl_loss, trl_grads, srl_loss, srl_grads):
    # on-policy grpo without IS has loss value 0 (Σ_g A = 0): the gradients carry the check
    assert max(float(g.abs().max()) for g in trl_grads.values()) > 1e-3
    assert srl_loss == pytest.approx(trl_loss, abs=ATOL, rel=1e-5)
    assert trl_grads.keys() == srl_grads.keys()
    for name, g in trl_grads.items():
        torch.testing.assert_close(srl_grads[name], g, atol=ATOL, rtol=1e-4, msg=name)


CASES = [
    {"loss_type": lt, "importance_sampling": is_mode}
    for lt in losses.LOSS_TYPES
    for is_mode in ("off", "token_truncate")
] + [
    {"loss_type": "dapo", "importance_sampling": "token_mask", "importance_sampling_max": 1.5},
    {
        "loss_type": "grpo",
        "importance_sampling": "sequence_mask",
        "importance_sampling_max": 3.0,
        "importance_sampling_min": 0.2,
    },
    {
        "loss_type": "bnpo",
        "importance_sampling": "sequence_truncate",
        "importance_sampling_max": 1.5,
        "importance_sampling_min": 0.5,
    },
    {"loss_type": "dr_grpo", "importance_sampling": "token_truncate", "scale_rewards": "none"},
    {"loss_type": "dapo", "importance_sampling": "token_truncate", "scale_rewards": "batch"},
    {"loss_type": "dapo", "importance_sampling": "token_truncate", "temperature": 0.7},
]


def _name(case):
    return "-".join(str(v) for v in case.values())


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_loss_and_gradients_match_trl(model_dir, data, tmp_path, case):
    trainer = _trl_trainer(model_dir, data, tmp_path, **case)
    trl_loss, trl_grads, out = _trl_loss(trainer)
    if case["importance_sampling"] != "off":  # the correction is really applied
        ratio = out["importance_sampling_ratio"]
        assert not torch.allclose(ratio, torch.ones_like(ratio))
    cfg = LearnerConfig(model=str(model_dir), max_completion_length=MAX_COMPLETION, **case)
    srl_loss, srl_grads = _streamrl_loss(model_dir, data, cfg)
    _assert_same(trl_loss, trl_grads, srl_loss, srl_grads)


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_micro_batches_match_trl_gradient_accumulation(model_dir, data, tmp_path, loss_type):
    case = {"loss_type": loss_type, "importance_sampling": "token_truncate"}
    trainer = _trl_trainer(model_dir, data, tmp_path, **case)
    trl_loss, trl_grads, _ = _trl_loss(trainer, chunks=3)
    cfg = LearnerConfig(
        model=str(model_dir), max_completion_length=MAX_COMPLETION, micro_batch_size=K, **case
    )
    srl_loss, srl_grads = _streamrl_loss(model_dir, data, cfg)
    _assert_same(trl_loss, trl_grads, srl_loss, srl_grads)


def test_bnpo_differs_from_dapo_only_under_accumulation(model_dir, data):
    """The check above is not vacuous: with micro-batches bnpo ≠ dapo, as in TRL."""
    base = {"model": str(model_dir), "micro_batch_size": K, "importance_sampling": "off"}
    dapo, _ = _streamrl_loss(model_dir, data, LearnerConfig(loss_type="dapo", **base))
    bnpo, _ = _streamrl_loss(model_dir, data, LearnerConfig(loss_type="bnpo", **base))
    assert abs(dapo - bnpo) > 1e-4


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_clipping_and_kl_match_trl(model_dir, data, tmp_path, loss_type):
    """π_θ ≠ π_old ≠ π_ref: move the policy after TRL scored the batch (so TRL's π_old and
    π_ref are the initial weights), then compare ``policy_loss`` with ``_compute_loss``."""
    case = {
        "loss_type": loss_type,
        "importance_sampling": "token_truncate",
        "epsilon": 0.05,
        "epsilon_high": 0.08,
        "delta": 1.1,
        "beta": 0.3,
    }
    trainer = _trl_trainer(model_dir, data, tmp_path, **case)
    out = trainer._generate_and_score_completions(
        [{"prompt": trainer.train_dataset[i // K]["prompt"]} for i in range(G * K)]
    )
    from transformers import AutoModelForCausalLM

    # a fresh copy: TRL patches its model's forward (fused LM head), a deepcopy would share it
    mine = AutoModelForCausalLM.from_pretrained(model_dir).train()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p_trl, p_mine in zip(trainer.model.parameters(), mine.parameters(), strict=True):
            step = 0.05 * torch.randn(p_trl.shape, generator=gen)
            p_trl.add_(step)
            p_mine.add_(step)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(trainer.model, out)
    trl_loss.backward()

    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    c = out["completion_ids"].size(1)
    logps = sequence_logps(mine, ids, attn, 1.0)[:, -c:]
    old = out["old_per_token_logps"]
    ratio = torch.exp(logps.detach() - old)
    mask = out["completion_mask"].float()
    assert ((ratio - 1).abs() * mask).max() > 0.1  # the clip is really exercised
    loss_cfg = losses.LossConfig(
        importance_sampling="token_truncate",
        importance_sampling_max=2.0,
        epsilon_low=0.05,
        epsilon_high=0.08,
        delta=1.1,
        beta=0.3,
        kl_bias_correction=True,
        loss_type=loss_type,
        max_completion_length=MAX_COMPLETION,
    )
    mine_loss = losses.policy_loss(
        logps,
        old,
        out["advantages"],
        mask,
        loss_cfg,
        behaviour_logps=out["sampling_per_token_logps"],
        ref_logps=out["ref_per_token_logps"],
    )
    mine_loss.backward()
    trl_grads = {n: p.grad for n, p in trainer.model.named_parameters()}
    mine_grads = {n: p.grad for n, p in mine.named_parameters()}
    _assert_same(float(trl_loss), trl_grads, float(mine_loss), mine_grads)
