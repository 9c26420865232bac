"""A byte-level tokenizer built locally (no download) with a chat template, for the ``tiny`` target.

256 byte tokens plus a few special tokens; wrapped as a transformers ``PreTrainedTokenizerFast`` so the
data pipeline treats it exactly like a real model's tokenizer (chat template, offsets).
"""

from __future__ import annotations

import functools
from typing import Any

SPECIAL_TOKENS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@functools.lru_cache(maxsize=1)
def build_tiny_tokenizer() -> Any:
    """Built once per process (it is stateless once built)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|end|>",
        pad_token="<|pad|>",
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf
