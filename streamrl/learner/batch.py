"""From groups to token tensors: which groups are trained on, and how a batch is laid out.

Layout. Every model turn of every sample is one sequence: ``prompt_token_ids + token_ids``,
right-padded. The loss falls on the turn's generated tokens only, each with the behaviour
log-probability the sampler reported. A multi-turn trajectory thus gives one sequence per
turn, all with the trajectory's advantage; a turn's prompt already holds the earlier turns
and tool outputs, which carry no loss. With ``loss_type="dapo"`` (token mean over the batch)
this is exactly the loss of one concatenated sequence with tool outputs masked; with
``grpo`` each turn is averaged as a sequence of its own. Turns without tokens are skipped.

Tensors are shifted for next-token prediction: position t of ``targets``/``mask``/
``behaviour_logps`` is token t+1 of the sequence, predicted from the logits at position t.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from streamrl.learner.losses import ScaleRewards, group_advantages
from streamrl.schema import Group


def rewards_of(group: Group) -> list[float]:
    """The scored samples' rewards (a failed sample has none)."""
    return [float(s.score.reward) for s in group.samples if s.score.reward is not None]


def is_zero_variance(group: Group, tol: float = 1e-9) -> bool:
    """All rewards equal (or fewer than two): every advantage would be 0, nothing to learn."""
    rewards = rewards_of(group)
    return len(rewards) < 2 or max(rewards) - min(rewards) <= tol


def _oldest_version(group: Group) -> int | None:
    """The oldest policy version that generated any token of the group (None: no tokens)."""
    versions = [t.policy_version for s in group.samples for t in s.trajectory.turns if t.token_ids]
    return min(versions) if versions else None


def staleness(group: Group, current_version: int) -> int:
    """How many policy versions behind the learner the group's oldest token is."""
    oldest = _oldest_version(group)
    return 0 if oldest is None else current_version - oldest


def has_tokens(group: Group) -> bool:
    return _oldest_version(group) is not None


@dataclass
class Batch:
    """B sequences padded to L tokens; shifted tensors are (B, L-1)."""

    input_ids: Tensor  # (B, L) long
    attention_mask: Tensor  # (B, L) long
    targets: Tensor  # (B, L-1) long: input_ids[:, 1:]
    mask: Tensor  # (B, L-1) float: 1 on generated tokens
    behaviour_logps: Tensor  # (B, L-1) float: NaN where unknown or not generated
    advantages: Tensor  # (B,)
    rewards: list[float]  # one per sample of the batch (not per sequence)
    num_groups: int
    num_samples: int
    prompt_lens: list[int] | None = None  # each sequence's prompt length (rows share prompts)
    # (B,) bool: rows sampled by exactly the learner's current weights (see learner.mismatch)
    on_policy: Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.input_ids.size(0)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum().item())

    def chunks(self, size: int) -> list[slice]:
        """Row slices of at most ``size`` sequences (size 0: one chunk)."""
        size = size or self.num_sequences
        return [slice(i, i + size) for i in range(0, self.num_sequences, size)]


def make_batch(
    groups: list[Group],
    pad_token_id: int,
    scale_rewards: ScaleRewards,
    weights_version: int | None = None,
) -> Batch:
    """Lay out ``groups`` as one batch with group-relative advantages (see module doc).
    ``weights_version``: the policy version the learner's weights are (None: none), which
    marks the rows whose turn that version sampled (``Batch.on_policy``)."""
    k_max = max(len(g.samples) for g in groups)
    rows = [[float(s.score.reward) for s in g.samples] for g in groups]
    rewards = torch.tensor([r + [math.nan] * (k_max - len(r)) for r in rows], dtype=torch.float64)
    adv = group_advantages(rewards.float(), scale_rewards).tolist()

    seqs: list[tuple[list[int], int, list[float], float]] = []
    versions: list[int] = []
    for i, g in enumerate(groups):
        for k, s in enumerate(g.samples):
            for turn in s.trajectory.turns:
                if not turn.token_ids:
                    continue
                lps = list(turn.logprobs)
                if len(lps) != len(turn.token_ids):
                    lps = [math.nan] * len(turn.token_ids)  # unknown: no correction
                ids = list(turn.prompt_token_ids) + list(turn.token_ids)
                seqs.append((ids, len(turn.prompt_token_ids), lps, adv[i][k]))
                versions.append(turn.policy_version)
    if not seqs:
        raise ValueError("no sequence in the batch has generated tokens")

    length = max(len(ids) for ids, *_ in seqs)
    # rows laid out as Python lists, one tensor each at the end: a few small tensor writes
    # per row cost the learner ~10 % of its step on the tiny model
    input_ids, attention, mask, behaviour = [], [], [], []
    for ids, p, lps, _ in seqs:
        pad = length - len(ids)
        input_ids.append(ids + [pad_token_id] * pad)
        attention.append([1] * len(ids) + [0] * pad)
        # generated token j sits at position p + j and is predicted at shifted position
        # p + j - 1; without a prompt the first token has no context and carries no loss
        start = max(p, 1)
        generated = len(ids) - start
        mask.append([0.0] * (start - 1) + [1.0] * generated + [0.0] * pad)
        behaviour.append([math.nan] * (start - 1) + lps[start - p :] + [math.nan] * pad)
    ids_t = torch.tensor(input_ids, dtype=torch.long)
    return Batch(
        input_ids=ids_t,
        attention_mask=torch.tensor(attention, dtype=torch.long),
        targets=ids_t[:, 1:],
        mask=torch.tensor(mask),
        behaviour_logps=torch.tensor(behaviour),
        advantages=torch.tensor([a for *_, a in seqs]),
        rewards=[float(s.score.reward) for g in groups for s in g.samples],
        num_groups=len(groups),
        num_samples=sum(len(g.samples) for g in groups),
        prompt_lens=[p for _, p, *_ in seqs],
        on_policy=None
        if weights_version is None
        else torch.tensor([v == weights_version for v in versions]),
    )
