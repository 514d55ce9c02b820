"""Reward functions exactly as TRL's documentation writes them, loaded by real verifier workers
as ``tests.support.trl_rewards:<function>``.

``format_reward_func`` (conversational form) and ``reward_func`` (standard form, with a
``ground_truth`` column) are copied unchanged from TRL's GRPO trainer guide, section "Using a
custom reward function", Examples 2 and 3: huggingface/trl, docs/source/grpo_trainer.md
(https://huggingface.co/docs/trl/grpo_trainer#using-a-custom-reward-function). The others are
this project's, written the way TRL allows: one that returns None where it does not apply,
one that raises on a row whose ``explode`` column is true, and one that reads what only the
trainer passes (``completion_ids``, ``trainer_state``, ``log_metric``).
"""

import re


# TRL docs, grpo_trainer.md, "Example 2: Reward completions with a specific format"
def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


# TRL docs, grpo_trainer.md, "Example 3: Reward completions based on a reference"
def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]  # noqa: B905


def answer_only_when_known(completions, answer, **kwargs):
    """1.0 when the <answer> is the row's answer; None (does not apply) when the row has none."""
    out = []
    for completion, expected in zip(completions, answer, strict=True):
        if expected is None:
            out.append(None)
            continue
        m = re.search(r"<answer>(.*?)</answer>", completion[0]["content"])
        out.append(1.0 if m and m.group(1).strip() == str(expected) else 0.0)
    return out


def explodes(completions, explode, **kwargs):
    """Raises on a row whose ``explode`` column is true: an infrastructure failure."""
    if any(explode):
        raise RuntimeError("reward backend unavailable")
    return [0.0 for _ in completions]


def always_none(completions, **kwargs):
    return [None for _ in completions]


def trainer_only(completions, completion_ids, trainer_state, log_metric, **kwargs):
    """What only the trainer passes: the sampled token ids and the trainer's step."""
    log_metric("seen_step", trainer_state.global_step)
    return [float(len(ids)) for ids in completion_ids]


async def async_length(completions, **kwargs):
    return [float(len(c)) for c in completions]


def two_rewards(completions, **kwargs):
    """Wrong: two rewards for one completion."""
    return [1.0, 0.0]


def not_a_number(completions, **kwargs):
    return ["high" for _ in completions]


def counter_answer(completions, start, numbers, **kwargs):
    """1.0 when the last reply is the counter's final value (a programmatic check of the
    counter environment's tasks, in TRL's conversational form)."""
    return [
        1.0 if completion[-1]["content"].strip() == str(s + sum(ns)) else 0.0
        for completion, s, ns in zip(completions, start, numbers, strict=True)
    ]
