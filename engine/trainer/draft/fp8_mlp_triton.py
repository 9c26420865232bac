"""The fused FP8 MLP op's CUDA kernels (draft/fp8_mlp.py ``gated_grads``, ``drafter_fp8_mlp = "fused"``), in Triton.

Two kernels over (tokens x features) tiles of the incoming gradient ``dh`` and the gate and up outputs ``g``, ``u``
(all (M, N) bf16, row-major): the first makes ``dg`` and ``du`` (silu's backward, rounded to bf16 where autograd's
eager decomposition rounds) and merges each tile's row and column maxima of both into one float32 buffer by atomic
max; the second makes them again and writes, for each, the e4m3 rows scaled per token, the e4m3 columns scaled per
feature and written transposed ((N, M') with M' the tokens padded with zeros to a multiple of 16), and the scales
(powers of two, from the maxima's float bits: ``fp8.quantize_rows``'s; values are multiplied by the exact
reciprocal). A NaN or infinite gradient gives its row and column an infinite scale, so the GEMMs that take them
come out non-finite, as the composed path's do, rather than quantised to finite values. Offsets are int64. Reads 12
bytes an element (dh, g, u twice), writes 4. Imported by ``fp8_mlp.register_cuda_kernels`` only: it needs Triton.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import triton
import triton.language as tl

from engine.trainer.draft.fp8 import MATMUL_ALIGN

# dg's then du's: rows (M, N) e4m3, row scales (M, 1) float32, cols (N, M') e4m3, col scales (N, 1) float32
GatedGrads = tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]
TILE_TOKENS, TILE_FEATURES = 64, 128  # the tile (tests/bench/bench_quant.py times others)
_LAUNCH_LOCK = threading.Lock()


@triton.jit
def _silu_mul_grads(dh_ptr, g_ptr, u_ptr, offs, mask):
    dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    # bf16 where autograd's eager decomposition rounds: silu(g), dh * u, and the two gradients
    du = (dh * (g * s).to(tl.bfloat16).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
    dgu = (dh * u).to(tl.bfloat16).to(tl.float32)
    dg = (dgu * (s * (1.0 + g * (1.0 - s)))).to(tl.bfloat16).to(tl.float32)
    return dg, du


@triton.jit
def _abs_nan_inf(x):
    """|x| with NaN as +inf: a non-finite gradient gives its row and column an infinite maximum, so their scales are
    infinite and the GEMMs that take them non-finite, as the composed path's NaN maxima make them (tl.max and the
    float max Triton emits drop NaN: a NaN would otherwise be quantised as a finite value)."""
    return tl.where(x == x, tl.abs(x), float("inf"))


@triton.jit
def _amax_kernel(dh_ptr, g_ptr, u_ptr, amax_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    """Each tile's row and column maxima of |dg| and |du|, merged by atomic max into amax: dg's rows (M), dg's
    columns (N), du's rows (M), du's columns (N), in that order."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    dg, du = _silu_mul_grads(dh_ptr, g_ptr, u_ptr, rm[:, None].to(tl.int64) * N + rn[None, :], mask)
    dg, du = _abs_nan_inf(dg), _abs_nan_inf(du)
    tl.atomic_max(amax_ptr + rm, tl.max(dg, 1), mask=rm < M)
    tl.atomic_max(amax_ptr + M + rn, tl.max(dg, 0), mask=rn < N)
    tl.atomic_max(amax_ptr + M + N + rm, tl.max(du, 1), mask=rm < M)
    tl.atomic_max(amax_ptr + 2 * M + N + rn, tl.max(du, 0), mask=rn < N)


@triton.jit
def _pow2_scale(amax):
    """(scale, 1 / scale) for maxima: fp8.pow2_scales' 2 ** ceil(log2(max(amax, AMAX_FLOOR) / 448)) from the float's
    bits (exact for the normal floats these are; the division rounds to nearest, as torch's), and its reciprocal
    from the same exponent, so quantising multiplies exactly (Triton's float division is not correctly rounded).
    An infinite maximum (a non-finite gradient) gives an infinite scale and a zero reciprocal."""
    v = tl.math.div_rn(tl.maximum(amax, 1e-12), 448.0)
    bits = v.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inverse = (tl.maximum(127 - exponent, 0) << 23).to(tl.float32, bitcast=True)  # 2 ** -exponent; 0 past the range
    return scale, inverse


@triton.jit
def _store_layouts(grad, amax_ptr, rs_ptr, cs_ptr, rows_ptr, cols_ptr, rm, rn, M, N, MP):
    """One gradient's tile: its e4m3 rows and transposed columns; the scales, by the tiles of the first
    column (row scales) and of the first row (column scales) of the grid."""
    row_scale, row_inverse = _pow2_scale(tl.load(amax_ptr + rm, mask=rm < M, other=0.0))
    col_scale, col_inverse = _pow2_scale(tl.load(amax_ptr + M + rn, mask=rn < N, other=0.0))
    if tl.program_id(1) == 0:
        tl.store(rs_ptr + rm, row_scale, mask=rm < M)
    if tl.program_id(0) == 0:
        tl.store(cs_ptr + rn, col_scale, mask=rn < N)
    # a NaN gradient stays NaN in e4m3, as the composed path's clamp keeps it. PropagateNan is named in each call:
    # Triton's compiler turns a local assignment into a tensor, and an enum is none ("cannot convert ... to tensor")
    rows = tl.clamp(grad * row_inverse[:, None], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)
    cols = tl.clamp(grad * col_inverse[None, :], -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)
    # int64 offsets: M x N passes 2 ** 31 from about 150k tokens at N 14336
    rows_at = rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(rows_ptr + rows_at, rows, mask=(rm[:, None] < M) & (rn[None, :] < N))
    # transposed, (N, MP): the padding tokens' columns (rm in [M, MP)) are written as zeros
    cols_at = rn[None, :].to(tl.int64) * MP + rm[:, None]
    tl.store(cols_ptr + cols_at, cols, mask=(rm[:, None] < MP) & (rn[None, :] < N))


@triton.jit
def _layouts_kernel(dh_ptr, g_ptr, u_ptr, amax_ptr, dg_rs, dg_cs, du_rs, du_cs, dg_rows, dg_cols, du_rows,
                    du_cols, M, N, MP, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    dg, du = _silu_mul_grads(dh_ptr, g_ptr, u_ptr, rm[:, None].to(tl.int64) * N + rn[None, :], mask)
    _store_layouts(dg, amax_ptr, dg_rs, dg_cs, dg_rows, dg_cols, rm, rn, M, N, MP)
    _store_layouts(du, amax_ptr + M + N, du_rs, du_cs, du_rows, du_cols, rm, rn, M, N, MP)


def triton_gated_grads(
    dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, tile: tuple[int, int] = (TILE_TOKENS, TILE_FEATURES)
) -> GatedGrads:
    """``gated_grads`` in two Triton kernels (contiguous (M, N) bf16 inputs on one CUDA device). Eight fresh
    tensors, none a view of another (a custom op's outputs may not alias)."""
    dh, g, u = dh.contiguous(), g.contiguous(), u.contiguous()
    m, n = dh.shape
    mp = m + (-m % MATMUL_ALIGN)
    bm, bn = tile
    grid = (triton.cdiv(mp, bm), triton.cdiv(n, bn))
    amax = torch.zeros(2 * (m + n), device=dh.device, dtype=torch.float32)
    e4m3, f32 = torch.float8_e4m3fn, torch.float32
    dg_rows, du_rows = (torch.empty(m, n, device=dh.device, dtype=e4m3) for _ in range(2))
    dg_cols, du_cols = (torch.empty(n, mp, device=dh.device, dtype=e4m3) for _ in range(2))
    dg_rs, du_rs = (torch.empty(m, 1, device=dh.device, dtype=f32) for _ in range(2))
    dg_cs, du_cs = (torch.empty(n, 1, device=dh.device, dtype=f32) for _ in range(2))
    # Kernels launch on the current device: the inputs' (TRITON_INTERPRET=1 runs them on the CPU's tensors). The
    # lock: drafter threads on other GPUs launch one at a time, so a kernel's first launch (Triton compiles it,
    # once a device) is made by one thread; a launch is queued, not waited on, so the lock is held microseconds.
    with _LAUNCH_LOCK, torch.cuda.device(dh.device) if dh.is_cuda else contextlib.nullcontext():
        _amax_kernel[grid](dh, g, u, amax, m, n, BM=bm, BN=bn)
        _layouts_kernel[grid](
            dh, g, u, amax, dg_rs, dg_cs, du_rs, du_cs, dg_rows, dg_cols, du_rows, du_cols, m, n, mp, BM=bm, BN=bn
        )
    return dg_rows, dg_rs, dg_cols, dg_cs, du_rows, du_rs, du_cols, du_cs
