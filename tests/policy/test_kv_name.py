"""`streamrl.models.kv`: the key/value cache goes to and comes from a model under the name the
installed transformers uses (``cache`` in 5.x, where ``past_key_values`` warns and goes in
5.40; ``past_key_values`` in 4.56), and decoding with it gives a full forward's logits."""

from __future__ import annotations

import inspect
import warnings

import torch

from streamrl.models.kv import cache_name, cache_of, with_cache
from streamrl.models.tiny import build_model


def test_the_name_is_the_forwards_own_and_the_cache_decodes_without_a_warning():
    model = build_model(seed=1).eval()
    assert cache_name() in inspect.signature(type(model).forward).parameters
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated name fails here
        head = model(input_ids=ids[:, :-1], use_cache=True)
        step = model(input_ids=ids[:, -1:], use_cache=True, **with_cache(cache_of(head)))
        whole = model(input_ids=ids, use_cache=False)
    assert cache_of(step) is not None
    torch.testing.assert_close(step.logits[:, -1], whole.logits[:, -1], rtol=1e-5, atol=1e-5)
