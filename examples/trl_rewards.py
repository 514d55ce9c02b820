"""Reward functions as a TRL GRPO script writes them: ``reward(prompts, completions, **kwargs)``
with the dataset's columns as keyword arguments. streamrl calls them unchanged."""

import re


def exact_answer(completions, ground_truth, **kwargs):
    """1.0 when the completion is the row's ground_truth, else 0.0 (standard form: strings)."""
    return [
        1.0 if c.strip() == gt else 0.0 for c, gt in zip(completions, ground_truth, strict=True)
    ]


def no_extra_words(completions, **kwargs):
    """1.0 when the completion is one number and nothing else."""
    return [1.0 if re.fullmatch(r"\s*-?\d+\s*", c) else 0.0 for c in completions]
