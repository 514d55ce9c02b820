"""The tiny model and tokenizer used by tests and ``streamrl demo``: real transformers classes,
built on the fly and seeded, so nothing is ever downloaded.

Tokenizer: WordLevel over whitespace-split words, vocabulary (in this order)
``<pad> <bos> <eos> <unk> <user> <assistant> copy :`` and the 16 symbols ``a``..``p``; left
padding. Chat template: ``<bos> <user> {content}``, then ``<assistant> {content} <eos>`` per
assistant turn, and ``<assistant>`` as the generation prompt, so the prompt ``copy : x y z`` is
8 tokens. Model: LlamaForCausalLM, hidden 64, intermediate 256, 2 layers, 4 heads, 64
positions, untied embeddings, initialised after ``torch.manual_seed(0)`` (~134k parameters).
"""

from __future__ import annotations

from pathlib import Path

_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<user>", "<assistant>"]
SYMBOLS = [chr(ord("a") + i) for i in range(16)]
_VOCAB = [*_SPECIALS, "copy", ":", *SYMBOLS]

_CHAT_TEMPLATE = (
    "{{ '<bos>' }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ ' <user> ' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ ' <assistant> ' + m['content'] + ' <eos>' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ' <assistant>' }}{% endif %}"
)


def build_tokenizer(words: list[str] | None = None, chat_template: str | None = None):
    """A word-level tokenizer over ``words`` (default: the copy task's vocabulary, specials
    first) with ``chat_template`` (default: the copy task's)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(words or _VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        padding_side="left",
    )
    tok.chat_template = chat_template or _CHAT_TEMPLATE
    return tok


def build_model(seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(_VOCAB),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=_VOCAB.index("<bos>"),
        eos_token_id=_VOCAB.index("<eos>"),
        pad_token_id=_VOCAB.index("<pad>"),
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_tiny(directory: str | Path, seed: int = 0) -> Path:
    """Write the tiny model and tokenizer as a normal HF directory (what the hf backend and the
    learner load)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_model(seed).save_pretrained(directory)
    build_tokenizer().save_pretrained(directory)
    return directory
