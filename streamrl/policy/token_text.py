"""A transformers tokenizer as the session codec leans on it (``session_codec.SessionTokens``):
a rollout worker that keeps a turn's token ids need not keep the same text again."""

from __future__ import annotations

import hashlib
import json
from typing import Any


class TokenizerText:
    """``encode``/``decode`` through the tokenizer's Rust core when it has one (what the
    ``hf`` backend tokenizes with), and a fingerprint of everything they depend on."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._core = getattr(tokenizer, "backend_tokenizer", None)
        if self._core is not None:
            spec = self._core.to_str()
        else:  # a slow tokenizer: its class, vocabulary and added tokens
            vocab = sorted(tokenizer.get_vocab().items())
            added = str(tokenizer.added_tokens_decoder)
            spec = json.dumps([type(tokenizer).__name__, vocab, added])
        self.fingerprint = hashlib.sha256(spec.encode()).hexdigest()[:32]

    def encode(self, text: str) -> list[int]:
        if self._core is not None:
            return self._core.encode(text, add_special_tokens=False).ids
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        if self._core is not None:
            return self._core.decode(ids, skip_special_tokens=False)
        return self._tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
