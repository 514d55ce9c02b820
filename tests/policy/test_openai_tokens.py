"""The ``openai`` backend's later turns as token ids (``_openai_tokens.continuation``): the
previous turn's exact ids, its end-of-turn token when it was cut, then only the new part of
the server's rendering. A real vLLM's renderings are in test_vllm.py."""

from __future__ import annotations

from streamrl.policy._openai_tokens import continuation
from streamrl.schema import Message, ModelTurn

EOS = 2


def turn(prompt: list[int], sampled: list[int]) -> ModelTurn:
    items = [Message(role="assistant", content="")]
    return ModelTurn(index=0, items=items, prompt_token_ids=prompt, token_ids=sampled,
                     logprobs=[0.0] * len(sampled))  # fmt: skip


def test_the_sampled_ids_are_kept_and_only_the_new_part_is_rendered():
    prev = turn([1, 10, 11], [20, 21, EOS])
    # the server re-tokenizes the model's words differently (22 for 20 21): kept as sampled
    before = [1, 10, 11, 22, EOS, 5]
    full = [1, 10, 11, 22, EOS, 5, 30, 31, EOS, 5, 40]
    assert continuation(prev, before, full, EOS) == [1, 10, 11, 20, 21, EOS, 5, 30, 31, EOS, 5, 40]


def test_a_turn_cut_at_its_length_is_closed_by_the_end_of_turn_token():
    prev = turn([1, 10], [20, 21])
    assert continuation(prev, [1, 10, 22, EOS], [1, 10, 22, EOS, 30], EOS) == [
        1, 10, 20, 21, EOS, 30,
    ]  # fmt: skip


def test_a_rendering_that_does_not_extend_the_earlier_one_is_refused():
    prev = turn([1, 10], [20, EOS])
    assert continuation(prev, [1, 10, 20, EOS], [1, 9, 20, EOS, 30], EOS) is None
    assert continuation(prev, [1, 10, 20], [1, 10, 20, 30], EOS) is None  # no end-of-turn
