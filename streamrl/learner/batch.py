"""From groups to token tensors: which groups are trained on, and how a batch is laid out.

Layout. Every model turn of every sample is a sequence ``prompt_token_ids + token_ids``,
right-padded, with the trajectory's advantage. The loss falls on generated tokens only, each
with the behaviour log-probability the sampler reported. When a later turn's prompt starts
with the earlier turn's whole sequence (the ``hf`` backend continues from the sampled tokens)
and the same policy version sampled both, the two are one row: the earlier turn's tokens,
then the tool outputs and template tokens (no loss), then the later turn's tokens. A
two-turn episode thus costs one forward over its last turn's sequence instead of two, which
repeat the whole prompt. Turns that do not chain (an OpenAI server's re-rendered prompt, a
policy update mid-episode) stay rows of their own. With ``loss_type="dapo"`` (token mean
over the batch) the loss is the same either way; with ``grpo`` each row is averaged as one
sequence. Turns without tokens are skipped.

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


_NOT_GENERATED = -math.inf  # in ``_Row.lps``: a prompt, tool-output or template token


@dataclass
class _Row:
    """One sequence: a turn, or a chain of turns where each turn's prompt starts with the
    previous turn's sequence (the hf backend's later turns do: see ``HFPolicy._continue``)."""

    ids: list[int]
    prompt_len: int  # the first turn's prompt
    lps: list[float]  # per token: behaviour log-prob (NaN: unknown), or _NOT_GENERATED
    advantage: float
    version: int

    def continued_by(self, prompt: list[int], version: int) -> bool:
        n = len(self.ids)
        return version == self.version and len(prompt) >= n and prompt[:n] == self.ids

    def extend(self, prompt: list[int], tokens: list[int], lps: list[float]) -> None:
        """Append what ``prompt`` adds to the row (none of it trained on), then the turn's
        tokens with their behaviour log-probs."""
        self.lps += [_NOT_GENERATED] * (len(prompt) - len(self.ids)) + lps
        self.ids = prompt + tokens


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

    rows_: list[_Row] = []
    for i, g in enumerate(groups):
        for k, s in enumerate(g.samples):
            row: _Row | None = None
            for turn in s.trajectory.turns:
                if not turn.token_ids:
                    continue
                lps = list(turn.logprobs)
                if len(lps) != len(turn.token_ids):
                    lps = [math.nan] * len(turn.token_ids)  # unknown: no correction
                if row is None or not row.continued_by(turn.prompt_token_ids, turn.policy_version):
                    row = _Row([], len(turn.prompt_token_ids), [], adv[i][k], turn.policy_version)
                    rows_.append(row)
                row.extend(list(turn.prompt_token_ids), list(turn.token_ids), lps)
    if not rows_:
        raise ValueError("no sequence in the batch has generated tokens")

    length = max(len(r.ids) for r in rows_)
    # rows laid out as Python lists, one tensor each at the end: a few small tensor writes
    # per row cost the learner ~10 % of its step on the tiny model
    input_ids, attention, mask, behaviour = [], [], [], []
    for r in rows_:
        pad = length - len(r.ids)
        input_ids.append(r.ids + [pad_token_id] * pad)
        attention.append([1] * len(r.ids) + [0] * pad)
        # token t + 1 is predicted at shifted position t; the first token has no context
        mask.append([0.0 if math.isinf(lp) else 1.0 for lp in r.lps[1:]] + [0.0] * pad)
        behaviour.append(
            [math.nan if math.isinf(lp) else lp for lp in r.lps[1:]] + [math.nan] * pad
        )
    ids_t = torch.tensor(input_ids, dtype=torch.long)
    return Batch(
        input_ids=ids_t,
        attention_mask=torch.tensor(attention, dtype=torch.long),
        targets=ids_t[:, 1:],
        mask=torch.tensor(mask),
        behaviour_logps=torch.tensor(behaviour),
        advantages=torch.tensor([r.advantage for r in rows_]),
        rewards=[float(s.score.reward) for g in groups for s in g.samples],
        num_groups=len(groups),
        num_samples=sum(len(g.samples) for g in groups),
        prompt_lens=[r.prompt_len for r in rows_],
        on_policy=None
        if weights_version is None
        else torch.tensor([r.version == weights_version for r in rows_]),
    )
