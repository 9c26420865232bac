"""Tiny random targets of every model family the trainer is checked against, saved as a Hugging Face directory.

Each family's config keeps the structural fields of the real checkpoint it names (attention kinds per layer, sliding
windows, chunked attention, attention sinks, MLA, MoE routing, tied embeddings, rope scaling, the architecture class,
multimodal wrappers) at tiny sizes: hidden 64, 4 query heads of 16, 8 decoder layers (the served aux layers 2, L/2,
L-3 stay distinct), a few experts. Windows and chunks are shrunk to 8 and 16 tokens so that a 128-token row crosses
them. The tokenizer is the repo's byte-level BPE with the family's special tokens and a chat template of the
family's shape (its turn markers, its end-of-turn token); ``generation_config.json`` lists the family's real stop
tokens by name, mapped to this tokenizer's ids.

    build_family("gemma-3", directory) -> directory holding config.json, model.safetensors, the tokenizer and
    generation_config.json, loadable with AutoModelForCausalLM / AutoTokenizer like the real checkpoint.

``packing`` says what the trainer does with ``packing = true``: None where packed rows equal unpacked ones, else the
words its one-line refusal names. Nothing here needs pytest (tests/device and tests/bench scripts may use it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).resolve().parents[1] / "unit" / "chat_templates"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, FFN = 64, 4, 2, 16, 8, 128
WINDOW = 8  # sliding windows, shrunk from the real 128..4096 so that a training row crosses them
CHUNK = 16  # Llama-4's chunked attention, shrunk from 8192

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN25 = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\n{% endif %}" + CHATML
)
LLAMA4 = (
    "{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
    "{{ m['content'] | trim }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)
GEMMA3 = (
    "{{ bos_token }}{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% else %}{% set role = 'model' if m['role'] == 'assistant' else 'user' %}"
    "<start_of_turn>{{ role }}\n{% if role == 'user' %}{{ ns.system }}{% set ns.system = '' %}{% endif %}"
    "{{ m['content'] | trim }}<end_of_turn>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: medium\n\n# Valid channels: analysis, commentary, final.<|end|>"
    "{% for m in messages %}{% if m['role'] == 'system' %}<|start|>developer<|message|># Instructions\n\n"
    "{{ m['content'] }}<|end|>{% elif m['role'] == 'user' %}<|start|>user<|message|>{{ m['content'] }}<|end|>"
    "{% else %}<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
PHI4 = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_sep|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant<|im_sep|>{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% set ns = namespace(system='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.system = m['content'] + '\n\n' %}"
    "{% elif m['role'] == 'user' %}[INST] {{ ns.system }}{{ m['content'] }} [/INST]{% set ns.system = '' %}"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
DEEPSEEK3 = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
GLM45 = (
    "[gMASK]<sop>{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n<think></think>\n"
    "{{ m['content'] }}{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
QWEN_STOPS = ("<|im_end|>", "<|endoftext|>")
QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")
LINEAR_REFUSAL = "linear_attention"


@dataclass(frozen=True)
class Family:
    name: str
    mirrors: str  # the released checkpoint whose structure the tiny config keeps
    architecture: str  # the class of the released checkpoint (a multimodal wrapper for Llama-4 and Gemma-3)
    config: Callable[[int, dict[str, int]], Any]  # (vocab size, special token ids) -> the transformers config
    specials: tuple[str, ...]
    eos: str  # the tokenizer's eos_token
    stops: tuple[str, ...]  # generation_config.json's eos_token_id, by name, in the real file's order
    chat_template: str
    bos: str | None = None
    pad: str | None = None
    attention: str = "full"  # the attention kinds, in words (the README's table)
    packing: str | None = None  # None: packed rows are exact; else what the refusal names
    multimodal: bool = False  # a vision wrapper around the text decoder (aux layers are the decoder's)


def _text(**kwargs: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "initializer_range": 0.1,  # a random target whose argmax depends on the input: something to learn
        "max_position_embeddings": 4096,
    }
    base.update(kwargs)
    return base


def _ids(specials: dict[str, int], *names: str) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: specials[name] for key, name in zip(keys, names, strict=True) if name}


def llama31(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        **_text(
            vocab_size=vocab,
            rope_parameters=dict(LLAMA3_ROPE),
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
        ),
        bos_token_id=sp["<|begin_of_text|>"],
        eos_token_id=[sp["<|end_of_text|>"], sp["<|eom_id|>"], sp["<|eot_id|>"]],
    )


def llama4(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import Llama4Config, Llama4TextConfig, Llama4VisionConfig

    text = Llama4TextConfig(
        **_text(
            vocab_size=vocab,
            intermediate_size=32,  # each expert's
            intermediate_size_mlp=FFN,
            tie_word_embeddings=False,
            rms_norm_eps=1e-5,
            max_position_embeddings=10485760,
        ),
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
        use_qk_norm=True,
        no_rope_layer_interval=4,  # every 4th layer: no rope, full attention; the rest: rope, chunked
        attention_chunk_size=CHUNK,
        attn_temperature_tuning=True,
        floor_scale=8192,
        attn_scale=0.1,
        rope_parameters={**LLAMA3_ROPE, "factor": 16.0, "high_freq_factor": 1.0},
        bos_token_id=sp["<|begin_of_text|>"],
        eos_token_id=[sp["<|end_of_text|>"], sp["<|eom|>"], sp["<|eot|>"]],
        pad_token_id=sp["<|finetune_right_pad|>"],
    )
    vision = Llama4VisionConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vision_output_dim=32,
        image_size=28,
        patch_size=14,
        projector_input_dim=32,
        projector_output_dim=HIDDEN,
    )
    return Llama4Config(
        text_config=text,
        vision_config=vision,
        boi_token_index=sp["<|image_start|>"],
        eoi_token_index=sp["<|image_end|>"],
        image_token_index=sp["<|image|>"],
        tie_word_embeddings=False,
        pad_token_id=sp["<|finetune_right_pad|>"],
    )


def qwen25(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        **_text(vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-6),
        use_sliding_window=False,  # as released: the window (131072) is configured but off
        sliding_window=131072,
        max_window_layers=28,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        **_ids(sp, "", "<|im_end|>", "<|endoftext|>"),
    )


def qwen3(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(
        **_text(vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-6),
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        **_ids(sp, "", "<|im_end|>", "<|endoftext|>"),
    )


def qwen3_moe(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_text(vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-6),
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        **_ids(sp, "", "<|im_end|>", "<|endoftext|>"),
    )


def qwen3_next(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_text(vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-6),
        # every 4th layer full (gated) attention, the rest gated DeltaNet linear attention
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(LAYERS)],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        norm_topk_prob=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        **_ids(sp, "", "<|im_end|>", "<|endoftext|>"),
    )


def gemma3(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        **_text(vocab_size=vocab, tie_word_embeddings=True, rms_norm_eps=1e-6),
        query_pre_attn_scalar=HEAD_DIM,
        sliding_window=WINDOW,
        sliding_window_pattern=6,  # 5 local (sliding) layers, then 1 global
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        **_ids(sp, "<bos>", "<eos>", "<pad>"),
    )
    vision = SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    return Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=sp["<start_of_image>"],
        eoi_token_index=sp["<end_of_image>"],
        image_token_index=sp["<image_soft_token>"],
        tie_word_embeddings=True,
    )


def gpt_oss(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        **_text(vocab_size=vocab, intermediate_size=32, tie_word_embeddings=False, rms_norm_eps=1e-5),
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(LAYERS)],
        attention_bias=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        **_ids(sp, "", "<|return|>", "<|endoftext|>"),
    )


def phi4(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import Phi3Config

    return Phi3Config(
        **_text(vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-5, max_position_embeddings=16384),
        original_max_position_embeddings=16384,
        sliding_window=None,  # as released (Phi-4 14B): full attention
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0},
        **_ids(sp, "<|endoftext|>", "<|im_end|>", "<|dummy_87|>"),
    )


def mistral(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import MistralConfig

    return MistralConfig(
        **_text(vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-5),
        sliding_window=WINDOW,  # Mistral-7B-v0.1's 4096-token window, shrunk
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        **_ids(sp, "<s>", "</s>", ""),
    )


def deepseek_v3(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        # head_dim is the rope part of a head, as DeepseekV3Config derives it (its rotary tables are that wide)
        **_text(vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-6, num_key_value_heads=HEADS, head_dim=8),
        moe_intermediate_size=32,
        q_lora_rank=32,  # multi-head latent attention: low-rank q and kv, a split rope/no-rope head
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
        },
        **_ids(sp, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    )


def glm45(vocab: int, sp: dict[str, int]) -> Any:
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        **_text(vocab_size=vocab, tie_word_embeddings=False, rms_norm_eps=1e-5),
        moe_intermediate_size=32,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5},
        eos_token_id=[sp["<|endoftext|>"], sp["<|user|>"], sp["<|observation|>"]],
        pad_token_id=sp["<|endoftext|>"],
    )


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama-3.1",
            "meta-llama/Llama-3.1-8B-Instruct",
            "LlamaForCausalLM",
            llama31,
            (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ),
            eos="<|eot_id|>",
            stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
            chat_template=_template("llama-3.1-8b-instruct.jinja"),
            bos="<|begin_of_text|>",
            attention="full; llama3 rope scaling",
        ),
        Family(
            "llama-4-scout",
            "meta-llama/Llama-4-Scout-17B-16E-Instruct",
            "Llama4ForConditionalGeneration",
            llama4,
            (
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|header_start|>",
                "<|header_end|>",
                "<|eot|>",
                "<|eom|>",
                "<|finetune_right_pad|>",
                "<|image_start|>",
                "<|image_end|>",
                "<|image|>",
            ),
            eos="<|eot|>",
            stops=("<|end_of_text|>", "<|eom|>", "<|eot|>"),
            chat_template=LLAMA4,
            bos="<|begin_of_text|>",
            pad="<|finetune_right_pad|>",
            attention=f"chunked ({CHUNK}) 3 of 4 layers, full NoPE every 4th; MoE top-1; vision wrapper",
            multimodal=True,
        ),
        Family(
            "qwen2.5",
            "Qwen/Qwen2.5-7B-Instruct",
            "Qwen2ForCausalLM",
            qwen25,
            QWEN_SPECIALS,
            eos="<|im_end|>",
            stops=QWEN_STOPS,
            chat_template=QWEN25,
            pad="<|endoftext|>",
            attention="full (use_sliding_window false, as released)",
        ),
        Family(
            "qwen3",
            "Qwen/Qwen3-8B",
            "Qwen3ForCausalLM",
            qwen3,
            QWEN_SPECIALS,
            eos="<|im_end|>",
            stops=QWEN_STOPS,
            chat_template=_template("qwen3-8b.jinja"),
            pad="<|endoftext|>",
            attention="full; q/k norm",
        ),
        Family(
            "qwen3-moe",
            "Qwen/Qwen3-30B-A3B",
            "Qwen3MoeForCausalLM",
            qwen3_moe,
            QWEN_SPECIALS,
            eos="<|im_end|>",
            stops=QWEN_STOPS,
            chat_template=_template("qwen3-8b.jinja"),
            pad="<|endoftext|>",
            attention="full; MoE top-2 of 4",
        ),
        Family(
            "qwen3-next",
            "Qwen/Qwen3-Next-80B-A3B-Instruct",
            "Qwen3NextForCausalLM",
            qwen3_next,
            QWEN_SPECIALS,
            eos="<|im_end|>",
            stops=QWEN_STOPS,
            chat_template=_template("qwen3-8b.jinja"),
            pad="<|endoftext|>",
            attention="linear (gated DeltaNet) 3 of 4 layers, full every 4th; MoE",
            packing=LINEAR_REFUSAL,
        ),
        Family(
            "gemma-3",
            "google/gemma-3-4b-it",
            "Gemma3ForConditionalGeneration",
            gemma3,
            (
                "<pad>",
                "<eos>",
                "<bos>",
                "<start_of_turn>",
                "<end_of_turn>",
                "<start_of_image>",
                "<end_of_image>",
                "<image_soft_token>",
            ),
            eos="<eos>",
            stops=("<eos>", "<end_of_turn>"),
            chat_template=GEMMA3,
            bos="<bos>",
            pad="<pad>",
            attention=f"sliding ({WINDOW}) 5 of 6 layers, full every 6th; tied embeddings; vision wrapper",
            multimodal=True,
        ),
        Family(
            "gpt-oss",
            "openai/gpt-oss-20b",
            "GptOssForCausalLM",
            gpt_oss,
            (
                "<|endoftext|>",
                "<|start|>",
                "<|end|>",
                "<|message|>",
                "<|channel|>",
                "<|return|>",
                "<|call|>",
                "<|constrain|>",
            ),
            eos="<|return|>",
            stops=("<|return|>", "<|endoftext|>", "<|call|>"),
            chat_template=HARMONY,
            pad="<|endoftext|>",
            attention=f"sliding ({WINDOW}) and full alternating; attention sinks; MoE; yarn rope",
        ),
        Family(
            "phi-4",
            "microsoft/phi-4",
            "Phi3ForCausalLM",
            phi4,
            ("<|endoftext|>", "<|im_start|>", "<|im_sep|>", "<|im_end|>", "<|dummy_87|>"),
            eos="<|im_end|>",
            stops=("<|im_end|>",),
            chat_template=PHI4,
            bos="<|endoftext|>",
            pad="<|dummy_87|>",
            attention="full (sliding_window null, as released); fused qkv and gate/up",
        ),
        Family(
            "mistral",
            "mistralai/Mistral-7B-Instruct-v0.1",
            "MistralForCausalLM",
            mistral,
            ("<s>", "</s>", "[INST]", "[/INST]"),
            eos="</s>",
            stops=("</s>",),
            chat_template=MISTRAL,
            bos="<s>",
            attention=f"sliding ({WINDOW}) every layer",
        ),
        Family(
            "deepseek-v3",
            "deepseek-ai/DeepSeek-V3",
            "DeepseekV3ForCausalLM",
            deepseek_v3,
            ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
            eos="<｜end▁of▁sentence｜>",
            stops=("<｜end▁of▁sentence｜>",),
            chat_template=DEEPSEEK3,
            bos="<｜begin▁of▁sentence｜>",
            pad="<｜end▁of▁sentence｜>",
            attention="MLA; grouped MoE routing (sigmoid, top-k groups); yarn rope",
        ),
        Family(
            "glm-4.5",
            "zai-org/GLM-4.5",
            "Glm4MoeForCausalLM",
            glm45,
            (
                "<|endoftext|>",
                "[gMASK]",
                "<sop>",
                "<|system|>",
                "<|user|>",
                "<|assistant|>",
                "<|observation|>",
                "<think>",
                "</think>",
            ),
            eos="<|endoftext|>",
            stops=("<|endoftext|>", "<|user|>", "<|observation|>"),
            chat_template=GLM45,
            pad="<|endoftext|>",
            attention="full; partial rotary (0.5); q/k norm; MoE with a shared expert",
        ),
    )
}


def build_tokenizer(family: Family) -> Any:
    """The repo's byte-level BPE with the family's special tokens, eos/bos/pad and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # The construction of engine/trainer/verifier/tiny_tokenizer.py, with this family's specials.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(family.specials))
    named: dict[str, Any] = {"eos_token": family.eos}
    if family.bos is not None:
        named["bos_token"] = family.bos
    if family.pad is not None:
        named["pad_token"] = family.pad
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, **named)
    hf.chat_template = family.chat_template
    return hf


def special_ids(tokenizer: Any, family: Family) -> dict[str, int]:
    ids = {name: int(tokenizer.convert_tokens_to_ids(name)) for name in family.specials}
    assert len(set(ids.values())) == len(ids), ids
    return ids


def stop_ids(family: Family, directory: Path) -> list[int]:
    """generation_config.json's eos_token_id of a built family: its real stop tokens, as this tokenizer's ids."""
    import json

    data = json.loads((Path(directory) / "generation_config.json").read_text(encoding="utf-8"))
    eos = data["eos_token_id"]
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def model_class(family: Family) -> Any:
    import transformers

    return getattr(transformers, family.architecture)


def build_family(name: str, directory: Path, *, seed: int = 0) -> Path:
    """The family's tiny random model, tokenizer and generation config saved in ``directory`` (created)."""
    import torch
    from transformers import GenerationConfig

    family = FAMILIES[name]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    sp = special_ids(tokenizer, family)
    vocab = ((len(tokenizer) + 7) // 8) * 8
    config = family.config(vocab, sp)
    config._attn_implementation = None  # the loader chooses (sdpa where the family supports it)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(family)(copy.deepcopy(config)).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    stops = [sp[s] for s in family.stops]
    gen: dict[str, Any] = {"eos_token_id": stops if len(stops) > 1 else stops[0]}
    if family.bos is not None:
        gen["bos_token_id"] = sp[family.bos]
    if family.pad is not None:
        gen["pad_token_id"] = sp[family.pad]
    GenerationConfig(**gen).save_pretrained(directory)
    return directory


# --- training a family's drafter through the engine ---------------------------------------------------------------
TRAIN_STEPS = 10
TRAIN_DRAFT_VOCAB = 256  # nearly all of these vocabularies (264-272): a random target's argmax is trainable


def train_config(target: Path, data: Path, out: Path, **overrides: Any) -> dict[str, Any]:
    """The engine config of a family's 10-step CPU run (tests/unit/trainer/verifier/test_target_families.py)."""
    config: dict[str, Any] = {
        "target": str(target),
        "data": str(data),
        "buckets": [128, 256],
        "batch_size": 2,
        "ttt_steps": 2,
        "draft_vocab_size": TRAIN_DRAFT_VOCAB,
        "steps": TRAIN_STEPS,
        "eval_holdout": 4,
        "output_dir": str(out),
        "torch_threads": 1,
        "heartbeat_interval_s": 0.2,
    }
    config.update(overrides)
    return config


def train_family(target: Path, data: Path, out: Path, **overrides: Any) -> tuple[int, list[dict[str, Any]]]:
    """10 steps of the real engine (``TrainingRun``) on a family's directory: (exit code, its step events)."""
    import os

    from engine.trainer.config import from_dict
    from engine.trainer.run.loop import TrainingRun
    from engine.trainer.threads.metrics import EventLog

    cfg = from_dict(train_config(target, data, out, **overrides))
    with open(os.devnull, "w") as quiet:
        events = EventLog(Path(out) / "events.jsonl", stdout=quiet)
        steps: list[dict[str, Any]] = []
        events.listeners.append(lambda ev: steps.append(ev) if ev["kind"] == "step" else None)
        run = TrainingRun(cfg, events)
        run.build()
        code = run.run()
        events.close()
    return code, steps
