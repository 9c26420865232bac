"""drafter_fp8's gated MLP as one node (engine/trainer/draft/fp8_mlp.py, drafter_fp8_mlp = "fused"): the same
numbers as the two FP8 Linears and autograd's ``silu(g) * u`` it replaces, bit for bit where both run eager (the
CPU's expressions), and where the unroll takes it (asked for, under "rowwise") or not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from test_cast_weights import TTT_STEPS, drafter  # same folder: pytest puts it on sys.path
from test_cast_weights import losses_and_grads as cast_unroll
from test_drafter_fp8 import two_torch_threads  # noqa: F401  (the autouse fixture: two torch threads here too)

from engine.trainer.config import (
    DRAFTER_FP8_MLP_COMPOSED,
    DRAFTER_FP8_MLP_FUSED,
    DRAFTER_FP8_ROWWISE,
    DRAFTER_FP8_ROWWISE_GW_HP,
)
from engine.trainer.draft import fp8_mlp
from engine.trainer.draft import fp8_mlp as fp8_mlp_module
from engine.trainer.draft.fp8 import fp8_linear, fp8_weight
from engine.trainer.draft.model import ttt_step


def operands(tokens: int, d_in: int = 64, d_ff: int = 96) -> tuple[torch.Tensor, ...]:
    """m, gate and up weights, and the gradient dh, with magnitudes spread over decades across tokens (so per-token
    and per-feature scales differ)."""
    g = torch.Generator().manual_seed(1)
    spread = 10 ** (torch.rand(tokens, 1, generator=g) * 4 - 2)
    m = torch.randn(tokens, d_in, generator=g) * spread
    wg, wu = (torch.randn(d_ff, d_in, generator=g) * 0.05 for _ in range(2))
    dh = torch.randn(tokens, d_ff, generator=g) * spread
    return m.bfloat16(), wg.bfloat16(), wu.bfloat16(), dh.bfloat16()


def run(m: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, dh: torch.Tensor, fused: bool) -> tuple[torch.Tensor, ...]:
    mr, wgr, wur = (t.detach().clone().requires_grad_() for t in (m, wg, wu))
    gate, up = (fp8_weight(w, grad_weight_fp8=True) for w in (wgr, wur))
    out = fp8_mlp.fp8_gated_mlp(mr, gate, up) if fused else F.silu(fp8_linear(mr, gate)) * fp8_linear(mr, up)
    out.backward(dh)
    assert mr.grad is not None and wgr.grad is not None and wur.grad is not None
    return out, mr.grad, wgr.grad, wur.grad


@pytest.mark.parametrize("tokens", [37, 48])
def test_the_fused_node_gives_the_composed_linears_numbers_bit_for_bit(tokens: int) -> None:
    """Output, the input's gradient and both weights' gradients equal the two FP8 Linears with autograd's silu * up,
    tokens off the 16 grid (37: grad_weight pads zero tokens) or on it (48)."""
    m, wg, wu, dh = operands(tokens)
    composed, fused = run(m, wg, wu, dh, fused=False), run(m, wg, wu, dh, fused=True)
    for name, a, b in zip(("out", "grad m", "grad gate", "grad up"), composed, fused, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(a, b), (name, (a.float() - b.float()).abs().max())
        assert b.abs().sum() > 0, name  # numbers, not zeros


def test_gated_grads_quantises_silus_gradients_per_token_and_per_feature_transposed() -> None:
    """The op's eight tensors: shapes, the padding tokens zero, and each layout the engine's quantize_rows of dg and
    du (autograd's silu backward) along its axis."""
    m_rows, n = 37, 96
    _, _, _, dh = operands(m_rows, d_ff=n)
    g = torch.randn(m_rows, n).bfloat16()
    u = torch.randn(m_rows, n).bfloat16()
    out = fp8_mlp.gated_grads(dh, g, u)
    assert [tuple(t.shape) for t in out] == [(37, 96), (37, 1), (96, 48), (96, 1)] * 2
    gr, ur = (t.detach().clone().requires_grad_() for t in (g, u))
    (F.silu(gr) * ur).backward(dh)
    assert gr.grad is not None and ur.grad is not None
    for grad, (rows, row_scale, cols, col_scale) in ((gr.grad, out[:4]), (ur.grad, out[4:])):
        want_rows, want_rs = fp8_mlp.quantize_rows(grad)
        assert torch.equal(rows.view(torch.uint8), want_rows.view(torch.uint8)) and torch.equal(row_scale, want_rs)
        padded = torch.cat([grad, grad.new_zeros(11, n)])
        want_cols, want_cs = fp8_mlp.quantize_rows(padded.t())
        assert torch.equal(cols.view(torch.uint8), want_cols.view(torch.uint8)) and torch.equal(col_scale, want_cs)
        assert cols.view(torch.uint8)[:, 37:].eq(0).all()


@pytest.mark.parametrize(
    ("fp8", "fp8_mlp", "fused_calls"),
    [
        (DRAFTER_FP8_ROWWISE, DRAFTER_FP8_MLP_FUSED, 1),
        (DRAFTER_FP8_ROWWISE, DRAFTER_FP8_MLP_COMPOSED, 0),
        (DRAFTER_FP8_ROWWISE_GW_HP, DRAFTER_FP8_MLP_FUSED, 0),
    ],
)
def test_the_unroll_takes_the_fused_node_where_asked_and_the_weight_gradients_are_fp8(
    fp8: str, fp8_mlp: str, fused_calls: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drafter_fp8_mlp = "fused" under "rowwise" runs every TTT step's gate and up as the one node, with the unroll's
    losses and gradients those of the composed Linears (eager CPU: bit for bit); "composed" (the default) and
    "rowwise_gw_hp" (bf16 weight gradients, which need the bf16 dg and du) compose the two Linears."""
    calls: list[int] = []
    real = fp8_mlp_module.gated_grads

    def counting(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(fp8_mlp_module, "gated_grads", counting)
    model = drafter()
    losses, grads, _ = cast_unroll(model, torch.bfloat16, ttt_step, fp8=fp8, fp8_mlp=fp8_mlp)
    assert len(calls) == fused_calls * TTT_STEPS, calls  # once a TTT step's backward, or never
    want_losses, want_grads, _ = cast_unroll(model, torch.bfloat16, ttt_step, fp8=fp8)
    assert torch.equal(losses, want_losses)
    assert grads.keys() == want_grads.keys() and all(torch.equal(grads[k], want_grads[k]) for k in grads)
    assert grads["layer.gate_proj.weight"].abs().sum() > 0 and grads["layer.up_proj.weight"].abs().sum() > 0


def test_an_unknown_mlp_way_is_refused_not_run_as_another() -> None:
    with pytest.raises(ValueError, match="fp8_mlp: got 'fuse'; allowed: composed, fused"):
        cast_unroll(drafter(), torch.bfloat16, ttt_step, fp8=DRAFTER_FP8_ROWWISE, fp8_mlp="fuse")
