"""A packed row's attention for each kind of target layer, or the one line that says why a target cannot be packed.

Packed rows (data/packing.py) reach the target with a ready mask, and Hugging Face uses a 4-D mask as it is: any rule
of the model's own masks that the given mask leaves out is lost. So the mask of each attention kind keeps that kind's
rule inside every conversation, positions counted from each conversation's first token:

* ``full_attention``: causal;
* ``sliding_attention``: causal over the last ``sliding_window`` positions (Mistral, Qwen2's window layers, Gemma-2/3,
  gpt-oss, Phi-3); transformers' rule, ``q - kv < sliding_window``;
* ``chunked_attention``: causal inside the query's chunk of ``attention_chunk_size`` positions (Llama-4).

A target of one kind gets one ``(B, 1, T, T)`` mask; a target of several the mapping its forward takes for mixed
layer types (``{"full_attention": ..., "sliding_attention": ...}``: Qwen2/3, Gemma-3, gpt-oss, Llama-4). A model run
with eager attention adds the mask to its scores, so it gets 0 and the dtype's minimum, not booleans (gpt-oss: its
attention sinks have no SDPA path). Sinks are one extra logit per head in every query's softmax, the same whatever
the keys: inside a conversation they give what the unpacked forward gives.

Refused, with one line naming the kind (``packing_refusal``, before the target's weights load): layers that carry a
recurrent state along the row (linear attention, state-space layers: Qwen3-Next, Qwen3.5, Jamba, Mamba), whose state
would run from one conversation into the next; any other layer kind these masks do not know; and Llama-4's attention
temperature tuning once a bucket reaches ``floor_scale`` (it scales NoPE layers' queries by the position in the row,
not in the conversation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.trainer.data.packing import document_causal_mask, document_positions

FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
PACKABLE: tuple[str, ...] = (FULL, SLIDING, CHUNKED)
# Layer kinds whose state runs along the row (transformers' layer_types names): packing would carry it across.
RECURRENT: tuple[str, ...] = ("linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding")
RECURRENT_MODEL_TYPES: tuple[str, ...] = ("mamba", "rwkv", "xlstm")  # no attention at all (no layer_types)


def text_config(config: Any) -> Any:
    """The decoder's config: a multimodal wrapper's ``text_config`` (Gemma-3, Llama-4), else the config itself."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        return getter()
    return getattr(config, "text_config", None) or config


def sliding_window(config: Any) -> int | None:
    """The window of a model whose layers all slide (no ``layer_types``): its ``sliding_window``, unless
    ``use_sliding_window`` turns it off (Qwen2 and Qwen3 before transformers 4.54 kept the value with the flag off)."""
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return int(window)
    return None


def layer_kinds(config: Any) -> list[str]:
    """The attention kind of every decoder layer, as the model's forward picks its masks: ``layer_types`` where the
    config has them, else one kind for all (sliding where a window is set: Mistral, Phi-3, Qwen3-MoE)."""
    text = text_config(config)
    types = getattr(text, "layer_types", None)
    if types:
        return [str(t) for t in types]
    kind = CHUNKED if getattr(text, "attention_chunk_size", None) else SLIDING if sliding_window(text) else FULL
    return [kind] * int(text.num_hidden_layers)


def packing_refusal(config: Any, longest_bucket: int) -> str | None:
    """Why packed rows of this target cannot equal its conversations alone (one line), or None."""
    text = text_config(config)
    model_type = str(getattr(text, "model_type", None) or getattr(config, "model_type", "this target"))
    kinds = layer_kinds(config)
    if any(word in model_type for word in RECURRENT_MODEL_TYPES):
        kinds = ["mamba"] * len(kinds)
    for kind in dict.fromkeys(kinds):
        if kind in PACKABLE:
            continue
        count = f"{kinds.count(kind)} of {len(kinds)} layers"
        if kind in RECURRENT:
            return (
                f"packing: target {model_type} has {kind} layers ({count}), whose recurrent state would run from one "
                "packed conversation into the next; set packing = false"
            )
        return (
            f"packing: target {model_type} has {kind} layers ({count}); packed rows keep only full, sliding-window "
            "and chunked attention apart; set packing = false"
        )
    floor_scale = getattr(text, "floor_scale", None)
    if getattr(text, "attn_temperature_tuning", False) and floor_scale and longest_bucket >= int(floor_scale):
        return (
            f"packing: target {model_type} scales its NoPE layers' queries by the position in the row "
            f"(attn_temperature_tuning, floor_scale {floor_scale}), so a packed conversation is exact only while rows "
            f"stay below {floor_scale} tokens; the longest bucket is {longest_bucket}: lower it or set packing = false"
        )
    return None


def packing_refusal_for(spec: str, longest_bucket: int) -> str | None:
    """``packing_refusal`` of a target directory from its config.json alone (no weights); None for a built-in."""
    path = Path(spec).expanduser()
    if not (path / "config.json").is_file():
        return None  # the built-in targets are Llamas (full attention)
    from transformers import AutoConfig

    return packing_refusal(AutoConfig.from_pretrained(str(path)), longest_bucket)


def packed_masks(config: Any, documents: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask(s) of a packed batch (``documents``: ``(B, T)`` conversation numbers): one ``(B, 1, T, T)``
    mask for a target of one attention kind, else ``{kind: mask}``. Boolean, or additive in ``dtype`` under eager
    attention. A kind ``packing_refusal`` refuses is a ValueError here (the engine never gets this far with one)."""
    text = text_config(config)
    kinds = list(dict.fromkeys(layer_kinds(config)))
    allowed = document_causal_mask(documents)  # (B, 1, T, T): causal, inside the query's conversation
    positions = document_positions(documents)
    q_pos, kv_pos = positions[:, None, :, None], positions[:, None, None, :]
    masks: dict[str, torch.Tensor] = {}
    for kind in kinds:
        if kind == FULL:
            mask = allowed
        elif kind == SLIDING:
            window = getattr(text, "sliding_window", None)
            if not window:
                raise ValueError(f"{kind} layers without a sliding_window in the config")
            mask = allowed & (q_pos - kv_pos < int(window))
        elif kind == CHUNKED:
            chunk = int(text.attention_chunk_size)
            mask = allowed & (q_pos.div(chunk, rounding_mode="floor") == kv_pos.div(chunk, rounding_mode="floor"))
        else:
            raise ValueError(f"{kind} layers cannot be packed (packing_refusal says why)")
        if getattr(text, "_attn_implementation", None) == "eager":
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
        masks[kind] = mask
    return masks[kinds[0]] if len(kinds) == 1 else masks
