"""The model configs of the built-in targets: ``tiny`` (and ``tiny-trained``, built from it) and the random
Llama-3.1-8B shape (``llama3-8b-shape``). Used by verifier.model to build them, by verifier.builtin to train
``tiny-trained`` and by export.py; a module of its own so that neither of the first two imports the other.
"""

from __future__ import annotations

from typing import Any

from engine.trainer.config import BUILTIN_TARGET_LAYERS


def tiny_config(vocab_size: int, hidden: int = 64, layers: int = 8, head_dim: int = 16) -> Any:
    from transformers import LlamaConfig

    heads = hidden // head_dim
    extra: dict[str, Any] = {"attn_implementation": "sdpa"}
    return LlamaConfig(
        **extra,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,  # a random target whose argmax depends on the token: learnable
        initializer_range=0.1,
    )


def llama3_8b_config() -> Any:
    from transformers import LlamaConfig

    extra: dict[str, Any] = {"attn_implementation": "sdpa"}
    try:  # transformers 5 keeps rope settings in rope_parameters, 4.x in rope_theta
        import inspect

        if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
            extra["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
        else:
            extra["rope_theta"] = 500000.0
    except (TypeError, ValueError):
        extra["rope_theta"] = 500000.0
    return LlamaConfig(
        **extra,
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=BUILTIN_TARGET_LAYERS["llama3-8b-shape"],
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
