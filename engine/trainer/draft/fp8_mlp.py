"""The drafter's gated MLP input in FP8 as one autograd node: ``silu(m @ Wg^T) * (m @ Wu^T)`` (``drafter_fp8``).

Composed from two ``fp8_linear`` calls and autograd's ``silu(g) * u``, the backward turns the gradient ``dh`` into
gate's and up's output gradients (``dg``, ``du``: silu's backward) and quantises each twice, per token along the
features (grad_input's operand) and per feature along the tokens (grad_weight's, written transposed: e4m3 GEMMs
take K-major operands). Compiled, inductor fused that into reductions that took 1.95 ms a TTT step at the 8B shape
and batch 4 on an H100, about 4.6x the memory floor of what they read and write (the engine's FP8 profile).

Here one node does it: the forward quantises ``m`` once for both GEMMs; the backward makes the eight tensors
(``gated_grads``: each gradient's e4m3 rows with their per-token scales, its transposed e4m3 columns with their
per-feature scales) in one custom op, then runs the four GEMMs, quantising ``m``'s transpose once for both weight
gradients. On CUDA the op is two Triton kernels (draft/fp8_mlp_triton.py: both gradients' row and column maxima in
one pass over tiles, then the four layouts in one more; ``register_cuda_kernels``, called by ``Drafter.forward``);
elsewhere it is the expressions ``_Fp8Matmul`` uses (the CPU's path, and the reference the CUDA kernels are held to
by tests/bench/bench_quant.py).

Taken with ``drafter_fp8_mlp = "fused"`` (the config; "composed", two ``fp8_linear`` calls, stays the default until
the kernels are timed in the whole engine on a GPU), and only for ``grad_weight_fp8`` (the "rowwise" recipe):
"rowwise_gw_hp" keeps the bf16 gradients for its bf16 weight GEMMs and composes the two Linears.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from engine.trainer.draft.fp8 import (
    MATMUL_ALIGN,
    Fp8Weight,
    _pad_tokens,
    _scaled_mm,
    quantize_rows,
)

# dg's then du's: rows (M, N) e4m3, row scales (M, 1) float32, cols (N, M') e4m3, col scales (N, 1) float32
GatedGrads = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]


def silu_mul_grads(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of ``silu(g) * u`` for the incoming gradient ``dh``, as autograd's decomposition makes them."""
    du = dh * F.silu(g)
    dg = torch.ops.aten.silu_backward(dh * u, g)
    return dg, du


def quantize_both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, N) per token (rows (M, N) e4m3, scales (M, 1)) and per feature along the tokens, transposed and padded
    with zero tokens to a multiple of MATMUL_ALIGN (cols (N, M') e4m3, scales (N, 1)): ``_Fp8Matmul``'s two."""
    rows, row_scale = quantize_rows(x)
    cols, col_scale = quantize_rows(_pad_tokens(x.t()))
    return rows, row_scale, cols, col_scale


def _gated_grads_reference(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> GatedGrads:
    dg, du = silu_mul_grads(dh, g, u)
    return (*quantize_both(dg), *quantize_both(du))


@torch.library.custom_op("specdec::fp8_gated_grads", mutates_args=())
def gated_grads(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> GatedGrads:
    """dg and du of ``silu(g) * u`` for ``dh`` (all (M, N) bf16), each quantised per token and per feature along the
    tokens (``quantize_both``). The expressions here; ``register_cuda_kernels`` gives CUDA its Triton kernels."""
    return _gated_grads_reference(dh, g, u)


@gated_grads.register_fake
def _gated_grads_fake(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> GatedGrads:
    m, n = dh.shape
    mp = m + (-m % MATMUL_ALIGN)
    out: list[torch.Tensor] = []
    for _ in range(2):
        out += [dh.new_empty(m, n, dtype=torch.float8_e4m3fn), dh.new_empty(m, 1, dtype=torch.float32)]
        out += [dh.new_empty(n, mp, dtype=torch.float8_e4m3fn), dh.new_empty(n, 1, dtype=torch.float32)]
    return tuple(out)  # type: ignore[return-value]


_cuda_kernels = False
_REGISTER_LOCK = threading.Lock()


def register_cuda_kernels() -> None:
    """Give the op its two Triton kernels on CUDA (draft/fp8_mlp_triton.py), once a process; before that, and on
    other devices, it runs the expressions. Triton is imported here, not at import: only a run that asks for the
    fused MLP needs it. Raises ImportError where Triton does not import (run/assembly.py says so before a run)."""
    global _cuda_kernels
    with _REGISTER_LOCK:
        if not _cuda_kernels:
            from engine.trainer.draft.fp8_mlp_triton import triton_gated_grads

            gated_grads.register_kernel("cuda")(triton_gated_grads)
            _cuda_kernels = True


class _Fp8GatedMlp(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        m: torch.Tensor,  # (M, in)
        gate_weight: torch.Tensor,  # (N, in): only its gradient is made here
        gate_rows: torch.Tensor,
        gate_row_scale: torch.Tensor,
        gate_cols: torch.Tensor,
        gate_col_scale: torch.Tensor,
        up_weight: torch.Tensor,
        up_rows: torch.Tensor,
        up_row_scale: torch.Tensor,
        up_cols: torch.Tensor,
        up_col_scale: torch.Tensor,
    ) -> torch.Tensor:  # (M, N) bf16
        mq, m_scale = quantize_rows(m)
        g = _scaled_mm(mq, gate_rows, m_scale, gate_row_scale)
        u = _scaled_mm(mq, up_rows, m_scale, up_row_scale)
        ctx.save_for_backward(m, g, u, gate_cols, gate_col_scale, up_cols, up_col_scale)
        ctx.weight_dtypes = (gate_weight.dtype, up_weight.dtype)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx: Any, dh: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        m, g, u, gate_cols, gate_col_scale, up_cols, up_col_scale = ctx.saved_tensors
        dg_rows, dg_rs, dg_cols, dg_cs, du_rows, du_rs, du_cols, du_cs = gated_grads(dh.to(g.dtype), g, u)
        grad_m = _scaled_mm(dg_rows, gate_cols, dg_rs, gate_col_scale) + _scaled_mm(
            du_rows, up_cols, du_rs, up_col_scale
        )
        mtq, mt_scale = quantize_rows(_pad_tokens(m.t()))  # per input feature along the tokens, once for both
        mt_scale = mt_scale.reshape(1, -1)
        grad_gate = _scaled_mm(dg_cols, mtq, dg_cs, mt_scale).to(ctx.weight_dtypes[0])
        grad_up = _scaled_mm(du_cols, mtq, du_cs, mt_scale).to(ctx.weight_dtypes[1])
        none4 = (None,) * 4
        return grad_m.to(m.dtype), grad_gate, *none4, grad_up, *none4


def fused_eligible(gate: Fp8Weight, up: Fp8Weight) -> bool:
    """Whether gate and up take ``fp8_gated_mlp``: marked for it (drafter_fp8_mlp = "fused"), their weight gradients
    in FP8 ("rowwise"), no fixed input."""
    return all(w.fused_mlp and w.grad_weight_fp8 and w.fixed_input is None for w in (gate, up))


def fp8_gated_mlp(m: torch.Tensor, gate: Fp8Weight, up: Fp8Weight) -> torch.Tensor:
    """``silu(m @ Wg^T) * (m @ Wu^T)`` (m (..., in)) with its six GEMMs in FP8 and one quantisation node: bf16 out."""
    flat = m.reshape(-1, m.shape[-1])
    out = _Fp8GatedMlp.apply(
        flat, gate.weight, gate.rows, gate.row_scale, gate.cols, gate.col_scale,
        up.weight, up.rows, up.row_scale, up.cols, up.col_scale,
    )  # fmt: skip
    return out.reshape(*m.shape[:-1], out.shape[-1])
