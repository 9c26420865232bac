"""The unroll's q/k/v: one matmul over the stacked weights, the embedding half made once and shifted per TTT step.

Step ``i`` reads token ``t + 1 + i`` at position ``t`` (the padding token past the end), so the embedding half of
its q/k/v is step 0's shifted by ``i``. These tests hold the unroll against a reference written the way EAGLE-3
states the layer: every step embeds its own tokens and projects ``[norm(emb), norm(hidden)]`` through each of
q, k and v whole, in float64, where only summation order can differ.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.loss import soft_cross_entropy, total_loss
from engine.trainer.draft.model import (
    DraftConfig,
    DraftDecoderLayer,
    Drafter,
    apply_rotary,
    shift_left,
    shift_rows,
    ttt_step,
)

VOCAB = 60
T = 20


def drafter() -> Drafter:
    cfg = DraftConfig(
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=VOCAB,
        draft_vocab_size=24,
        initializer_range=0.2,  # far from uniform attention, so a wrong token or position shows in the loss
    )
    torch.manual_seed(0)
    return Drafter(cfg, torch.randn(VOCAB, 32, dtype=torch.float64), torch.arange(24) * 2).double()


def reference_layer(
    layer: DraftDecoderLayer,
    hidden: torch.Tensor,
    emb: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    prior_k: torch.Tensor | None,
    prior_v: torch.Tensor | None,
    mask: Any,
    attention: TTTAttention,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The decoder layer as EAGLE-3 states it: q, k and v each from the whole 2H-wide input."""
    b, t, _ = hidden.shape
    d, nh, nkv = layer.cfg.head_dim, layer.cfg.num_heads, layer.cfg.num_kv_heads
    x = torch.cat((layer.input_layernorm(emb), layer.hidden_norm(hidden)), dim=-1)
    q = apply_rotary(layer.q_proj(x).view(b, t, nh, d).transpose(1, 2), cos, sin)
    k = apply_rotary(layer.k_proj(x).view(b, t, nkv, d).transpose(1, 2), cos, sin)
    v = layer.v_proj(x).view(b, t, nkv, d).transpose(1, 2)
    k_all = k if prior_k is None else torch.cat((prior_k, k), dim=2)
    v_all = v if prior_v is None else torch.cat((prior_v, v), dim=2)
    attn = attention.apply(q, k_all, v_all, mask).transpose(1, 2).reshape(b, t, nh * d)
    h = hidden + layer.o_proj(attn)
    m = layer.post_attention_layernorm(h)
    return h + layer.down_proj(F.silu(layer.gate_proj(m)) * layer.up_proj(m)), k_all, v_all


def unroll(model: Drafter, reference: bool, steps: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, T), generator=g)
    hidden3 = torch.randn(2, T, 96, generator=g, dtype=torch.float64)
    target_p = torch.softmax(torch.randn(2, T, 24, generator=g, dtype=torch.float64) * 2, -1)
    mask = (torch.rand(2, T, generator=g) > 0.2).double()
    model.zero_grad(set_to_none=True)
    step_fn = None
    if reference:
        embeddings = [F.embedding(shift_left(ids, i + 1), model.embed_table) for i in range(steps)]

        def step_fn(
            layer: DraftDecoderLayer,
            norm: Any,
            head: Any,
            hidden: Any,
            _emb_qkv: Any,
            cos: Any,
            sin: Any,
            prior_k: Any,
            prior_v: Any,
            mask: Any,
            attention: Any,
            target_p: Any,
            position_mask: Any,
            shift: int,
            *tail: Any,
        ) -> Any:
            # The same step, with a layer that embeds step shift - 1's own tokens instead of taking the half.
            own = OwnTokensLayer(layer, embeddings[shift - 1])
            return ttt_step(
                own,
                norm,
                head,
                hidden,
                _emb_qkv,
                cos,
                sin,
                prior_k,
                prior_v,
                mask,
                attention,
                target_p,
                position_mask,
                shift,
                *tail,
            )

    losses, _, _ = model(
        hidden3,
        ids,
        target_p,
        mask,
        ttt_steps=steps,
        attention=TTTAttention("sdpa"),
        loss_fn=soft_cross_entropy,
        step_fn=step_fn,
        loss_mask=mask,
    )
    total_loss(losses).backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class OwnTokensLayer(torch.nn.Module):
    """The reference decoder layer on one step's own embeddings (what the unroll passes instead is ignored)."""

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
        _weights: Any = None,
        _emb_qkv: Any = None,
    ) -> Any:
        return reference_layer(self.inner, hidden, self.emb, cos, sin, prior_k, prior_v, mask, attention)


@pytest.mark.parametrize("n", [0, 1, 5, T - 1, T, T + 3])
def test_the_shifted_embedding_half_is_what_the_step_would_project_from_its_own_tokens(n: int) -> None:
    model = drafter()
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first = model.layer.embedding_qkv(F.embedding(shift_left(ids, 1), model.embed_table))
        own = model.layer.embedding_qkv(F.embedding(shift_left(ids, n + 1), model.embed_table))
    assert torch.equal(shift_rows(first, n), own)  # the same rows, moved: bit for bit


@pytest.mark.parametrize("steps", [1, 4, T + 2])
def test_the_unroll_equals_every_step_projecting_its_own_tokens_through_whole_qkv_weights(steps: int) -> None:
    model = drafter()
    losses, grads = unroll(model, reference=False, steps=steps)
    ref_losses, ref_grads = unroll(model, reference=True, steps=steps)
    assert losses.shape == (steps,) and bool(losses[: T - 1].abs().min() > 0)  # past the end nothing is trained
    torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=0)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-10, atol=1e-14, msg=name)


def test_the_comparison_fails_when_the_steps_read_their_tokens_one_position_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine.trainer.draft.model as model_module

    model = drafter()
    ref_losses, _ = unroll(model, reference=True, steps=3)
    monkeypatch.setattr(model_module, "shift_rows", lambda x, n: shift_rows(x, n + 1))
    off, _ = unroll(model, reference=False, steps=3)
    assert (off - ref_losses).abs().min() > 1e-6
