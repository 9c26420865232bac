"""The EAGLE-3 drafter: fc over three target layers, one decoder layer, frozen embeddings, draft-vocab head.

The training-time test (TTT) unrolls the drafter ``ttt_steps`` times; step ``i`` attends to the keys of
steps ``0..i`` (see masks.py). Each step is a pure function of its inputs, prior K/V included, so gradient
checkpointing (``use_reentrant=False``) recomputes it without appending to a cache twice.

Rotary positions advance with the TTT step, as served: step ``i`` (0-based) rotates its queries and keys
with positions ``arange(T) + i``, and the keys of earlier steps keep the rotation of their own step.
SpecForge does the same (its attention adds ``lck``, the number of cached steps, to ``position_ids``);
vLLM and SGLang advance the position by one for every drafted token. ``ttt_rope_offset=False`` gives
every step positions ``arange(T)`` (this trainer's first behaviour), kept only to compare acceptance.

Packed rows (``documents``, data/packing.py): positions restart at 0 in every conversation (the rotary tables
are gathered per token, ``(B, 1, T, D)``), the attention mask keeps each conversation to itself, and the
shifted targets of step ``i`` count only where token ``t + 1 + i`` is in ``t``'s conversation, so a packed
row trains exactly what its conversations would train unpacked.

q, k and v are one matmul over their weights stacked (``qkv_proj``). Its embedding half, ``norm(emb) @ W[:, :H]^T``,
depends only on the token a position reads, and step ``i`` reads the tokens step 0 reads moved ``i`` places, so an
unroll makes it once (``DraftDecoderLayer.embedding_qkv``) and every step takes it shifted (``shift_rows``): of
``ttt_steps`` embedding-half matmuls (forward, weight and input-norm gradients) one runs. The same function, summed
in another order (a float64 test holds it to 1e-10 against every step projecting its own tokens).

``drafter_fp8`` (draft/fp8.py): ``Drafter.fp8_weights`` quantises every Linear's weight once an unroll (fc, the two
q/k/v halves apart, o, the MLP, the head), and fc's input with them, and each matmul runs as ``project`` over an
``Fp8Weight``: forward and both gradients as row-wise scaled e4m3 GEMMs (with ``drafter_fp8_mlp = "fused"``, gate and
up as one node whose backward quantises both gradients in one op: draft/fp8_mlp.py).

Weights start as Hugging Face initialises a Llama (and as SpecForge's draft model does through
``post_init``): every Linear ``normal(0, initializer_range)`` with zero bias, every RMSNorm weight one.
The token embeddings are the target's, frozen: a buffer, never a parameter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from engine.trainer.config import (
    DRAFTER_FP8,
    DRAFTER_FP8_MLP,
    DRAFTER_FP8_MLP_COMPOSED,
    DRAFTER_FP8_OFF,
    DRAFTER_FP8_ROWWISE,
    fused_mlp_runs,
)
from engine.trainer.data.packing import document_positions, same_document_after
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.fp8 import Fp8Weight, Layouts, project, weight_layouts
from engine.trainer.draft.fp8_mlp import fp8_gated_mlp, fused_eligible, register_cuda_kernels
from engine.trainer.draft.rows import TrainedRows

# (logits, target_logits, target_lse, position_mask[, loss_mask]) -> (loss, correct count, accuracy denominator);
# see loss.py.
LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass
class DraftConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    initializer_range: float = 0.02  # std of the Linear weights at init (the target's, as HF configs carry it)

    @classmethod
    def from_target(cls, hf_config: Any, draft_vocab_size: int) -> DraftConfig:
        heads = int(hf_config.num_attention_heads)
        hidden = int(hf_config.hidden_size)
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        rope_theta = getattr(hf_config, "rope_theta", None)
        if rope_theta is None:
            rope = getattr(hf_config, "rope_parameters", None) or {}
            rope_theta = rope.get("rope_theta", 10000.0) if isinstance(rope, dict) else 10000.0
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            intermediate_size=int(hf_config.intermediate_size),
            vocab_size=int(hf_config.vocab_size),
            draft_vocab_size=draft_vocab_size,
            rms_norm_eps=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            initializer_range=float(getattr(hf_config, "initializer_range", None) or 0.02),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of every FP8 GEMM's weight (FP8_WEIGHTS) of a drafter of this config: what drafter_fp8 needs
        in multiples of 16, known before any weight exists."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * d
        shapes = {FC: (h, 3 * h), QKV_EMBEDDING: (qkv_rows, h), QKV_HIDDEN: (qkv_rows, h)}
        shapes |= {"o_proj": (h, self.num_heads * d), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
        shapes[HEAD] = (self.draft_vocab_size, h)
        return {name: shapes[name] for name in FP8_WEIGHTS}


# The decoder layer's Linears and the head: the parameters an unroll's matmuls read.
LAYER_LINEARS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
HEAD = "lm_head"
# q, k and v run as one matmul over their weights stacked, [W_q; W_k; W_v] ((nh + 2 nkv) d x 2H): "qkv_proj".
QKV_LINEARS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
QKV = "qkv_proj"
# The weights Drafter.cast_weights casts once an unroll: the stacked q/k/v, the rest of the layer's, the head.
CAST_WEIGHTS: tuple[str, ...] = (QKV, "o_proj", "gate_proj", "up_proj", "down_proj", HEAD)
# Drafter.fp8_weights: every Linear GEMM's weight, the stacked q/k/v as its two halves (each its own matmul, so each
# its own row scales), and fc, which runs once an unroll before the steps.
FC = "fc"
FC_INPUT = "fc.input"  # fc's input (the target's states) in fp8.weight_layouts' call: quantised with the weights
QKV_EMBEDDING, QKV_HIDDEN = "qkv_proj.embedding", "qkv_proj.hidden"
FP8_WEIGHTS: tuple[str, ...] = (FC, QKV_EMBEDDING, QKV_HIDDEN, "o_proj", "gate_proj", "up_proj", "down_proj", HEAD)
# A Linear's weight as the steps take it: a tensor (the parameter, or its cast) or, under drafter_fp8, an Fp8Weight.
Weights = dict[str, torch.Tensor | Fp8Weight]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each ``(seq_len, head_dim)`` float32: row ``p`` rotates position ``p``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(
    x: torch.Tensor,  # (B, heads, T, D)
    cos: torch.Tensor,  # (T, D), or (B, 1, T, D) for packed rows
    sin: torch.Tensor,  # (T, D), or (B, 1, T, D)
) -> torch.Tensor:  # (B, heads, T, D)
    return (x * cos.to(x.dtype)) + (_rotate_half(x) * sin.to(x.dtype))


class DraftDecoderLayer(nn.Module):
    """EAGLE-3's decoder layer: attention input is [norm(embedding), norm(hidden)] (2H wide), q/k/v one matmul."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q_proj = nn.Linear(2 * h, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def qkv_weight(self, weights: Weights | None = None) -> torch.Tensor:
        """``[W_q; W_k; W_v]``, ``((nh + 2 nkv) d, 2H)``: ``weights[QKV]`` when cast once, else stacked here."""
        if weights is not None:
            stacked = weights[QKV]
            assert isinstance(stacked, torch.Tensor)
            return stacked
        return torch.cat([getattr(self, name).weight for name in QKV_LINEARS])

    def qkv_halves(self, weights: Weights | None = None) -> tuple[torch.Tensor | Fp8Weight, torch.Tensor | Fp8Weight]:
        """The q/k/v weight's embedding half and hidden half, ``((nh + 2 nkv) d, H)`` each (FP8: quantised apart)."""
        if weights is not None and QKV_EMBEDDING in weights:
            return weights[QKV_EMBEDDING], weights[QKV_HIDDEN]
        stacked, h = self.qkv_weight(weights), self.cfg.hidden_size
        return stacked[:, :h], stacked[:, h:]

    def embedding_qkv(self, emb: torch.Tensor, weights: Weights | None = None) -> torch.Tensor:
        """The embedding half of q, k and v side by side, ``(B, T, (nh + 2 nkv) d)``: ``norm(emb) @ W[:, :H]^T``.

        It depends on the token a position reads and nothing else, so an unroll computes it once and every TTT step
        takes it shifted (``shift_rows``): step ``i`` reads token ``t + 1 + i`` where step 0 reads ``t + 1``.
        """
        return project(self.input_layernorm(emb), self.qkv_halves(weights)[0])

    def forward(
        self,
        hidden: torch.Tensor,  # (B, T, H): the step's hidden state
        emb: torch.Tensor | None,  # (B, T, H): embeddings of the tokens it reads; None when emb_qkv is given
        cos: torch.Tensor,  # (T, D): this step's rotary tables
        sin: torch.Tensor,  # (T, D)
        prior_k: torch.Tensor | None,  # (B, Hkv, i*T, D): the keys of steps 0..i-1; None at step 0
        prior_v: torch.Tensor | None,  # (B, Hkv, i*T, D)
        mask: Any,  # a flex BlockMask or a dense bool (T, (i+1)*T)
        attention: TTTAttention,
        weights: Weights | None = None,  # Drafter.cast_weights or fp8_weights: the Linears' weights, made once
        emb_qkv: torch.Tensor | None = None,  # (B, T, (nh + 2 nkv) d): embedding_qkv of those tokens, made already
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # hidden (B, T, H), k_all and v_all (B, Hkv, (i+1)*T, D)
        b, t, _ = hidden.shape
        d, nh, nkv = self.cfg.head_dim, self.cfg.num_heads, self.cfg.num_kv_heads

        def linear(name: str, x: torch.Tensor) -> torch.Tensor:
            module = getattr(self, name)
            return project(x, weights[name] if weights is not None else module.weight, module.bias)

        if emb_qkv is None:
            if emb is None:
                raise ValueError("the decoder layer needs the embeddings or their q/k/v half (emb_qkv)")
            emb_qkv = self.embedding_qkv(emb, weights)
        # q, k, v = [norm(emb), norm(hidden)] @ W^T, the embedding half made by embedding_qkv.
        qkv = project(self.hidden_norm(hidden), self.qkv_halves(weights)[1]) + emb_qkv
        q, k, v = qkv.split((nh * d, nkv * d, nkv * d), dim=-1)
        q = apply_rotary(q.reshape(b, t, nh, d).transpose(1, 2), cos, sin)
        k = apply_rotary(k.reshape(b, t, nkv, d).transpose(1, 2), cos, sin)
        v = v.reshape(b, t, nkv, d).transpose(1, 2)
        if prior_k is not None and prior_v is not None:
            k_all = torch.cat((prior_k, k), dim=2)
            v_all = torch.cat((prior_v, v), dim=2)
        else:
            k_all, v_all = k, v
        attn = attention.apply(q, k_all, v_all, mask)
        attn = attn.transpose(1, 2).reshape(b, t, nh * d)
        h_out = hidden + linear("o_proj", attn)
        m = self.post_attention_layernorm(h_out)
        gate, up = (weights[n] if weights is not None else None for n in ("gate_proj", "up_proj"))
        if isinstance(gate, Fp8Weight) and isinstance(up, Fp8Weight) and fused_eligible(gate, up):
            act = fp8_gated_mlp(m, gate, up)  # FP8: one node, its backward's quantisations in one op
        else:
            act = F.silu(linear("gate_proj", m)) * linear("up_proj", m)
        h_out = h_out + linear("down_proj", act)
        return h_out, k_all, v_all


def shift_left(x: torch.Tensor, n: int, fill: float = 0.0) -> torch.Tensor:  # x (B, T, ...) -> (B, T, ...)
    """Drop the first ``n`` positions (dim 1) and pad the end with ``fill``: keeps the bucket's shape fixed."""
    if n == 0:
        return x
    if n >= x.shape[1]:
        return torch.full_like(x, fill)
    return torch.cat((x[:, n:], torch.full_like(x[:, :n], fill)), dim=1)


def shift_rows(x: torch.Tensor, n: int) -> torch.Tensor:  # x (B, T, C) -> (B, T, C)
    """Drop the first ``n`` positions (dim 1) and repeat the last one ``n`` times at the end (shape kept).

    Over ``embedding_qkv`` of the tokens step 0 reads (the last is the padding token ``shift_left`` puts there),
    this gives what step ``n`` reads: token ``t + 1 + n`` at ``t``, the padding token past the end.
    """
    if n == 0:
        return x
    n = min(n, x.shape[1] - 1)
    return torch.cat((x[:, n:], x[:, -1:].expand(-1, n, -1)), dim=1)


def ttt_step(
    layer: DraftDecoderLayer,
    norm: RMSNorm,
    lm_head: nn.Linear,
    hidden: torch.Tensor,  # (B, T, H)
    emb_qkv: torch.Tensor,  # (B, T, (nh + 2 nkv) d): layer.embedding_qkv of the tokens step 0 reads
    cos: torch.Tensor,  # (T, D)
    sin: torch.Tensor,  # (T, D)
    prior_k: torch.Tensor | None,  # (B, Hkv, i*T, D); None at step 0
    prior_v: torch.Tensor | None,  # (B, Hkv, i*T, D)
    mask: Any,  # a flex BlockMask or a dense bool (T, (i+1)*T)
    attention: TTTAttention,
    target_logits: torch.Tensor,  # (B, T, Vd): the target's over the draft vocabulary, unshifted (loss.py)
    target_lse: torch.Tensor,  # (B, T) float32: their log-sum-exp, unshifted
    position_mask: torch.Tensor,  # (B, T) float32, unshifted
    shift: int,  # i + 1: positions to shift the targets by
    loss_fn: LossFn,
    loss_mask: torch.Tensor | None = None,  # (B, T), unshifted
    documents: torch.Tensor | None = None,  # (B, T): packed rows' conversation numbers (data/packing.py)
    weights: Weights | None = None,  # Drafter.cast_weights or fp8_weights: the Linears' weights, made once
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,  # (index, weight) of the rows it trains (draft/rows.py)
) -> tuple[torch.Tensor, ...]:  # hidden (B, T, H), k_all, v_all (B, Hkv, (i+1)*T, D), loss, correct, count ()
    """One TTT step, decoder layer through loss: a pure function of its inputs (checkpoint- and compile-safe).

    ``emb_qkv``: the embedding half of q/k/v, made once for the unroll; this step takes it shifted by ``shift - 1``
    (the tokens it reads). ``cos``/``sin`` are this step's rotary tables (``Drafter.step_rotary``). ``loss_mask``,
    when given, is the accuracy's denominator (see loss.py). ``documents``: a shifted target counts only inside the
    position's own conversation (never across a packed row's boundary). Compiled as one graph on CUDA
    (norms, rotary, flex attention, MLP, head and loss fused where they can be). ``weights``: the layer's and
    the head's Linear weights to use instead of the modules' own (see ``Drafter.cast_weights``). ``rows``: the
    head and the loss run on those rows of ``B*T`` only, the positions this step trains (draft/rows.py); the
    same loss, accuracy and gradients as over every position, up to rounding. (With the drafter's GEMMs in FP8 the
    head's weight gradient scales each feature by its largest value over the rows it is given: an untrained row
    no longer sets that scale, so values near e4m3's smallest round differently.)
    """
    step_qkv = shift_rows(emb_qkv, shift - 1)
    hidden, k_all, v_all = layer(hidden, None, cos, sin, prior_k, prior_v, mask, attention, weights, step_qkv)
    head = weights[HEAD] if weights is not None else lm_head.weight
    mask_i = shift_left(position_mask, shift)
    loss_mask_i = shift_left(loss_mask, shift) if loss_mask is not None else None
    if documents is not None:
        inside = same_document_after(documents, shift)
        mask_i = mask_i * inside.to(mask_i.dtype)
        loss_mask_i = loss_mask_i * inside.to(loss_mask_i.dtype) if loss_mask_i is not None else None
    if rows is not None:
        index, weight = rows
        b, t, h = hidden.shape
        # Row r trains position index[r] against the target at index[r] + shift: the same sequence, never past it
        # (padding rows, weight 0, are clamped inside the batch).
        source = (index + shift).clamp_max(b * t - 1)
        logits = project(norm(hidden.reshape(b * t, h).index_select(0, index)), head, lm_head.bias)
        target_rows = target_logits.reshape(b * t, -1).index_select(0, source)
        lse_rows = target_lse.reshape(b * t).index_select(0, source)
        loss, correct, _ = loss_fn(logits, target_rows, lse_rows, weight, None, positions=b * t)
        count = (loss_mask_i if loss_mask_i is not None else mask_i).sum()
        return hidden, k_all, v_all, loss, correct, count
    logits = project(norm(hidden), head, lm_head.bias)
    target_i = shift_left(target_logits, shift)
    lse_i = shift_left(target_lse, shift, float("inf"))  # p = 0 past the end
    if loss_mask_i is None:
        loss, correct, count = loss_fn(logits, target_i, lse_i, mask_i)
    else:
        loss, correct, count = loss_fn(logits, target_i, lse_i, mask_i, loss_mask_i)
    return hidden, k_all, v_all, loss, correct, count


class Drafter(nn.Module):
    def __init__(
        self,
        cfg: DraftConfig,
        embed_weight: torch.Tensor,
        draft_to_target: torch.Tensor,
        *,
        ttt_rope_offset: bool = True,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.ttt_rope_offset = ttt_rope_offset
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.layer = DraftDecoderLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        # Frozen: the target's token embeddings (shared with the target when on the same device and dtype).
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        d2t = draft_to_target.long() - torch.arange(draft_to_target.numel(), device=draft_to_target.device)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool, device=draft_to_target.device)
        t2d[draft_to_target.long()] = True
        self.register_buffer("d2t", d2t)  # EAGLE-3's convention: target id = draft id + d2t[draft id]
        self.register_buffer("t2d", t2d)
        # Per-step tables per (bucket, TTT steps, offset, device): a handful per run, made once.
        self._rotary: dict[tuple[int, int, bool, str], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._positions: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> the longest table so far
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Hugging Face's Llama init: Linear weights normal(0, initializer_range), biases zero, norms one."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                module.weight.normal_(0.0, self.cfg.initializer_range)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    @property
    def embed_table(self) -> torch.Tensor:
        table = self.embed_weight
        assert isinstance(table, torch.Tensor)
        return table

    def rotary(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions ``0..seq_len-1``: row ``p`` rotates position ``p`` (any drafted token's).

        Prefix views of one table per device, grown by doubling: a caller stepping through every length
        (chain drafting) keeps one table, not one per length.
        """
        key = str(device)
        table = self._positions.get(key)
        if table is None or table[0].shape[0] < seq_len:
            length = max(seq_len, 2 * table[0].shape[0]) if table is not None else seq_len
            table = rotary_tables(length, self.cfg.head_dim, self.cfg.rope_theta, device)
            self._positions[key] = table
        return table[0][:seq_len], table[1][:seq_len]

    def step_rotary(
        self, seq_len: int, ttt_steps: int, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin per TTT step: step ``i`` covers positions ``i..i+seq_len-1`` (``0..`` without the offset).

        Slices of one table of ``seq_len + ttt_steps`` positions, each made contiguous once and cached, so every
        step hands a compiled TTT step the same shape and stride (no recompile per step from the tables).
        """
        key = (seq_len, ttt_steps, self.ttt_rope_offset, str(device))
        tables = self._rotary.get(key)
        if tables is None:
            cos, sin = rotary_tables(seq_len + ttt_steps, self.cfg.head_dim, self.cfg.rope_theta, device)
            offsets = range(ttt_steps) if self.ttt_rope_offset else [0] * ttt_steps
            tables = [(cos[i : i + seq_len].contiguous(), sin[i : i + seq_len].contiguous()) for i in offsets]
            self._rotary[key] = tables
        return tables

    @torch.no_grad()
    def document_rotary(self, documents: torch.Tensor, ttt_steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin per TTT step for packed rows, each ``(B, 1, T, D)``: positions restart per conversation."""
        positions = document_positions(documents)
        cos, sin = self.rotary(documents.shape[-1] + ttt_steps, documents.device)
        offsets = range(ttt_steps) if self.ttt_rope_offset else [0] * ttt_steps
        return [(cos[positions + i][:, None], sin[positions + i][:, None]) for i in offsets]

    def forward(
        self,
        hidden3: torch.Tensor,  # (B, T, 3H): the target's three captured layers
        input_ids: torch.Tensor,  # (B, T) long
        target_logits: torch.Tensor,  # (B, T, Vd): the target's over the draft vocabulary (loss.py)
        target_lse: torch.Tensor,  # (B, T) float32: their log-sum-exp
        position_mask: torch.Tensor,  # (B, T) float32
        *,
        ttt_steps: int,
        attention: TTTAttention,
        loss_fn: LossFn,
        grad_checkpointing: bool = False,
        step_fn: Callable[..., Any] | None = None,
        loss_mask: torch.Tensor | None = None,  # (B, T)
        documents: torch.Tensor | None = None,  # (B, T): packed rows' conversation numbers
        weight_dtype: torch.dtype | None = None,  # cast the TTT steps' Linear weights once (cast_weights)
        fp8: str = DRAFTER_FP8_OFF,  # drafter_fp8: the Linears' GEMMs in FP8 (draft/fp8.py), weights from fp8_weights
        fp8_layouts: Callable[..., Any] | None = None,  # fp8_weights' layouts_fn (the engine's compiled one)
        fp8_mlp: str = DRAFTER_FP8_MLP_COMPOSED,  # drafter_fp8_mlp: "fused" runs gate and up as one FP8 node
        rows: TrainedRows | None = None,  # the rows each step trains (draft/rows.py): head and loss on those only
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # loss, correct, counts: each (ttt_steps,)
        """Unrolled TTT. Returns per-step (loss, correct count, counted positions), each a ``(ttt_steps,)`` tensor.

        Position ``t`` of step ``i`` reads token ``t + 1 + i`` at rotary position ``t + i`` and predicts the
        target's distribution at position ``t + 1 + i``; step 0's hidden state is the fused target state at
        ``t``. ``loss_mask`` (the data's, before the draft-vocabulary filter) makes the counted positions
        SpecForge's accuracy denominator; without it they are the ``position_mask`` positions. ``documents``
        (packed rows): positions, attention and shifted targets stay inside each conversation. ``weight_dtype``:
        the steps run on ``cast_weights(weight_dtype)`` instead of the parameters themselves. ``fp8`` (a recipe, not
        "off"): every Linear, fc and the head included, runs its GEMMs in FP8 on ``fp8_weights``, made once here.
        ``rows`` (``trained_rows`` of this batch's ``position_mask`` and ``documents``): each step's head and loss
        run on the positions it trains only (draft/rows.py); the same losses, counts and gradients up to rounding
        (see ``ttt_step``).
        """
        if rows is not None and len(rows.index) < ttt_steps:
            raise ValueError(f"rows: {len(rows.index)} TTT steps of rows for a {ttt_steps}-step unroll")
        if fp8 not in DRAFTER_FP8:  # callers past the config (benchmarks) must not run another recipe than named
            raise ValueError(f"fp8: got {fp8!r}; allowed: {', '.join(DRAFTER_FP8)}")
        if fp8_mlp not in DRAFTER_FP8_MLP:
            raise ValueError(f"fp8_mlp: got {fp8_mlp!r}; allowed: {', '.join(DRAFTER_FP8_MLP)}")
        fused_mlp = fused_mlp_runs(fp8, fp8_mlp)
        if fused_mlp and hidden3.is_cuda:
            register_cuda_kernels()  # once a process (the engine's config check made it already; benchmarks here)
        seq_len = input_ids.shape[1]
        weights: Weights | None = None
        if fp8 != DRAFTER_FP8_OFF:
            gw_fp8 = fp8 == DRAFTER_FP8_ROWWISE
            weights = self.fp8_weights(
                weight_dtype,
                grad_weight_fp8=gw_fp8,
                layouts_fn=fp8_layouts,
                fc_input=hidden3,
                fused_mlp=fused_mlp,
            )
        elif weight_dtype is not None:
            weights = self.cast_weights(weight_dtype)
        if documents is None:
            rotary = self.step_rotary(seq_len, ttt_steps, input_ids.device)
        else:
            rotary = self.document_rotary(documents, ttt_steps)
        hidden = project(hidden3, weights[FC]) if weights is not None and FC in weights else self.fc(hidden3)
        if weights is not None:
            weights = {name: w for name, w in weights.items() if name != FC}  # the steps' (fc runs once, here)
        with torch.no_grad():
            emb = F.embedding(shift_left(input_ids, 1), self.embed_table)  # the tokens step 0 reads
        # The embedding half of q/k/v once for the unroll: every step reads the same tokens, shifted (shift_rows).
        emb_qkv = self.layer.embedding_qkv(emb, weights)
        prior_k: torch.Tensor | None = None
        prior_v: torch.Tensor | None = None
        losses, correct, counts = [], [], []
        step = step_fn if step_fn is not None else ttt_step
        for i in range(ttt_steps):
            mask = attention.prepare(input_ids.device, seq_len, i, documents)  # outside any compiled region
            cos, sin = rotary[i]
            args = (self.layer, self.norm, self.lm_head, hidden, emb_qkv, cos, sin, prior_k, prior_v, mask, attention)
            tail: tuple[Any, ...] = (target_logits, target_lse, position_mask, i + 1, loss_fn, loss_mask, documents)
            tail = (*tail, weights) if rows is None else (*tail, weights, rows.step(i))
            if grad_checkpointing and torch.is_grad_enabled():
                out = checkpoint(step, *args, *tail, use_reentrant=False)
            else:
                out = step(*args, *tail)
            hidden, prior_k, prior_v, loss_i, correct_i, count_i = out
            losses.append(loss_i)
            correct.append(correct_i)
            counts.append(count_i)
        return torch.stack(losses), torch.stack(correct), torch.stack(counts)

    def cast_weights(self, dtype: torch.dtype) -> Weights:
        """The TTT steps' Linear weights cast to ``dtype`` once, for every step of an unroll (differentiable).

        Under autocast a compiled TTT step casts the fp32 parameters inside its graph, and autograd adds each
        step's fp32 gradient into ``.grad``: ``ttt_steps`` casts and ``ttt_steps - 1`` fp32 additions per weight a
        training step. Cast once, the steps' gradients meet at the cast in ``dtype`` and reach ``.grad`` once:
        what eager autocast does anyway for a parameter (it caches the cast; there this changes nothing, bit for
        bit, except for the stacked q/k/v, which is no parameter and is cast at every use without it), and the
        numerics of SpecForge's bf16 parameters with fp32 masters (its gradients also sum in bf16 across steps).
        For an unroll under autocast to ``dtype`` (the inputs of the steps are then in ``dtype`` too). The keys are
        CAST_WEIGHTS: q, k and v stacked as one (``QKV``), then the layer's other Linears and the head.
        """

        def weight(name: str) -> torch.Tensor:
            if name == QKV:
                return self.layer.qkv_weight()
            return self.lm_head.weight if name == HEAD else getattr(self.layer, name).weight

        return {name: weight(name).to(dtype) for name in CAST_WEIGHTS}

    def fp8_weights(
        self,
        dtype: torch.dtype | None,
        *,
        grad_weight_fp8: bool,
        layouts_fn: Callable[..., Any] | None = None,
        fc_input: torch.Tensor | None = None,
        fused_mlp: bool = False,
    ) -> Weights:
        """Every Linear's weight (FP8_WEIGHTS) cast to ``dtype`` (None: as it is) and quantised to e4m3, once a
        training step: the steps' gradients meet at the cast, as ``cast_weights``'s do, and reach the parameters
        (their dtype unchanged) once. ``grad_weight_fp8``: the weight gradients' GEMMs in FP8 too (draft/fp8.py).
        ``layouts_fn``: fp8.weight_layouts as the engine runs it (compiled on CUDA, under the compile guard); None:
        eager. ``fc_input`` (the target's states fc will take, (..., 3H)): quantised in the same call, both layouts,
        and carried by fc's weight (``Fp8Weight.fixed_input``), so fc's GEMMs make no pass over it of their own.
        ``fused_mlp``: gate's and up's weights say so (``Fp8Weight.fused_mlp``), and the layer runs them as one node
        (draft/fp8_mlp.py) where their weight gradients are FP8."""
        layer, h = self.layer, self.cfg.hidden_size
        qkv = layer.qkv_weight()
        tensors = {FC: self.fc.weight, QKV_EMBEDDING: qkv[:, :h], QKV_HIDDEN: qkv[:, h:], HEAD: self.lm_head.weight}
        tensors |= {name: getattr(layer, name).weight for name in FP8_WEIGHTS if name not in tensors}
        casts = {name: tensors[name].to(dtype or tensors[name].dtype) for name in FP8_WEIGHTS}
        # Detached inputs: no graph is recorded, in grad mode still (the mode the compiled function was warmed in).
        detached = {n: c.detach() for n, c in casts.items()}
        if fc_input is None:
            layouts: dict[str, Layouts] = (layouts_fn or weight_layouts)(detached)
        else:
            inputs = {FC_INPUT: fc_input.detach().reshape(-1, fc_input.shape[-1])}
            layouts = (layouts_fn or weight_layouts)(detached, inputs)
        fixed = {FC: layouts[FC_INPUT]} if fc_input is not None else {}
        fused = {"gate_proj", "up_proj"} if fused_mlp else set()
        return {
            name: Fp8Weight(
                casts[name],
                *layouts[name],
                grad_weight_fp8=grad_weight_fp8,
                fixed_input=fixed.get(name),
                fused_mlp=name in fused,
            )
            for name in FP8_WEIGHTS
        }

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]
