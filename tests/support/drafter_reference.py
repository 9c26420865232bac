"""The drafter's TTT step as EAGLE-3 states it, to hold the engine's against: every step embeds its own tokens and
projects ``[norm(emb), norm(hidden)]`` through each of q, k and v whole (the engine stacks q/k/v and makes their
embedding half once an unroll, draft/model.py). Used by the unit tests (float64, the CPU) and by
tests/bench/bench_kernels.py's ``unroll`` part (the 8B drafter on a GPU: agreement and time)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from engine.trainer.draft.model import QKV, DraftDecoderLayer, apply_rotary, shift_left, ttt_step


def reference_layer(
    layer: DraftDecoderLayer,
    hidden: torch.Tensor,  # (B, T, H)
    emb: torch.Tensor,  # (B, T, H): the embeddings of the tokens this step reads
    cos: torch.Tensor,
    sin: torch.Tensor,
    prior_k: torch.Tensor | None,
    prior_v: torch.Tensor | None,
    mask: Any,
    attention: Any,
    weights: dict[str, torch.Tensor] | None = None,  # the engine's cast weights (q/k/v stacked), or the modules'
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder layer with q, k and v each from the whole 2H-wide input."""
    b, t, _ = hidden.shape
    d, nh, nkv = layer.cfg.head_dim, layer.cfg.num_heads, layer.cfg.num_kv_heads

    def weight(name: str) -> torch.Tensor:
        if weights is None:
            return getattr(layer, name).weight
        if name in ("q_proj", "k_proj", "v_proj"):  # rows of the stacked [W_q; W_k; W_v]
            wq, wk, wv = weights[QKV].split((nh * d, nkv * d, nkv * d))
            return {"q_proj": wq, "k_proj": wk, "v_proj": wv}[name]
        return weights[name]

    x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(hidden)), dim=-1)
    q = apply_rotary(F.linear(x, weight("q_proj")).view(b, t, nh, d).transpose(1, 2), cos, sin)
    k = apply_rotary(F.linear(x, weight("k_proj")).view(b, t, nkv, d).transpose(1, 2), cos, sin)
    v = F.linear(x, weight("v_proj")).view(b, t, nkv, d).transpose(1, 2)
    k_all = k if prior_k is None else torch.cat((prior_k, k), dim=2)
    v_all = v if prior_v is None else torch.cat((prior_v, v), dim=2)
    attn = attention.apply(q, k_all, v_all, mask).transpose(1, 2).reshape(b, t, nh * d)
    h = hidden + F.linear(attn, weight("o_proj"))
    m = layer.post_attention_layernorm(h)
    mlp = F.linear(F.silu(F.linear(m, weight("gate_proj"))) * F.linear(m, weight("up_proj")), weight("down_proj"))
    return h + mlp, k_all, v_all


class OwnTokensLayer(torch.nn.Module):
    """The reference layer on one step's own embeddings (the unroll's shifted half it is handed is ignored)."""

    def __init__(self, layer: DraftDecoderLayer, emb: torch.Tensor) -> None:
        super().__init__()
        self.inner = layer
        self.emb = emb

    def forward(
        self,
        hidden: Any,
        _emb: Any,
        cos: Any,
        sin: Any,
        prior_k: Any,
        prior_v: Any,
        mask: Any,
        attention: Any,
        weights: Any = None,
        _emb_qkv: Any = None,
    ) -> Any:
        return reference_layer(self.inner, hidden, self.emb, cos, sin, prior_k, prior_v, mask, attention, weights)


def step_embeddings(input_ids: torch.Tensor, table: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """What each TTT step reads: step ``i`` the embeddings of token ``t + 1 + i`` (the padding token past the end)."""
    with torch.no_grad():
        return [F.embedding(shift_left(input_ids, i + 1), table) for i in range(steps)]


def own_tokens_step(embeddings: Sequence[torch.Tensor]) -> Callable[..., Any]:
    """A ``step_fn`` for ``Drafter.forward``: the engine's ttt_step around the reference layer, step ``i`` on
    ``embeddings[i]`` (``step_embeddings`` of the batch being trained)."""

    def step(layer: DraftDecoderLayer, norm: Any, head: Any, hidden: Any, emb_qkv: Any, *rest: Any) -> Any:
        shift = rest[9]  # cos, sin, prior_k, prior_v, mask, attention, target_logits, target_lse, position_mask, shift
        return ttt_step(OwnTokensLayer(layer, embeddings[shift - 1]), norm, head, hidden, emb_qkv, *rest)

    return step
