"""How turns become learner rows (``learner.batch``): a chain of turns that continue each
other's tokens is one row; anything else stays apart."""

from __future__ import annotations

import math

import torch

from streamrl import schema
from streamrl.learner.batch import make_batch
from streamrl.schema import Group, Message, ModelTurn, Sample, Score, Trajectory


def _turn(index: int, prompt: list[int], tokens: list[int], version: int = 0) -> ModelTurn:
    return ModelTurn(index=index, items=[Message(role="assistant", content="x")],
                     prompt_token_ids=prompt, token_ids=tokens,
                     logprobs=[-0.1 * (t % 7 + 1) for t in tokens],
                     policy_version=version)  # fmt: skip


def _group(turns_per_sample: list[list[ModelTurn]]) -> Group:
    samples = []
    for k, turns in enumerate(turns_per_sample):
        traj = Trajectory(task_id=f"p:{k}", prompt_id="p", k=k, group_size=2, env="counter",
                          items=[], turns=turns, status="completed")  # fmt: skip
        samples.append(Sample(score=Score(task_id=f"p:{k}", prompt_id="p", k=k, reward=float(k)),
                              trajectory=traj))  # fmt: skip
    return Group(schema.SCHEMA_VERSION, "p", 2, 0.5, 0.5, samples)


def test_a_chain_of_turns_is_one_row_with_loss_only_on_sampled_tokens():
    prompt, first, tool, second = [1, 4, 6], [7, 8, 2], [5, 9], [10, 2]
    chained = [_turn(0, prompt, first), _turn(1, prompt + first + tool, second)]
    broken = [_turn(0, prompt, first), _turn(1, [*prompt, 11, *tool], second)]  # re-rendered
    later = [_turn(0, prompt, first), _turn(1, prompt + first + tool, second, version=1)]
    batch = make_batch([_group([chained, broken]), _group([later, [_turn(0, prompt, [])]])],
                       pad_token_id=0, scale_rewards="group", weights_version=0)  # fmt: skip
    assert batch.num_sequences == 1 + 2 + 2  # chained: 1; re-rendered: 2; new version: 2
    row = batch.input_ids[0].tolist()
    assert row == prompt + first + tool + second
    on = batch.mask[0].bool()
    assert batch.targets[0][on].tolist() == first + second  # never the tool output
    want = [-0.1 * (t % 7 + 1) for t in first + second]
    assert batch.behaviour_logps[0][on].tolist() == torch.tensor(want).tolist()
    assert all(math.isnan(x) for x in batch.behaviour_logps[0][~on].tolist())
    assert batch.prompt_lens[:3] == [3, 3, 6]
    assert batch.on_policy.tolist() == [True, True, True, True, False]
    assert batch.advantages[1] == batch.advantages[2]  # both rows of one sample
