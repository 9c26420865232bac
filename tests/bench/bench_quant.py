"""The FP8 drafter's costliest non-GEMM kernel, timed alone: the backward's quantisation of the MLP gradient.

With ``drafter_fp8 = "rowwise"`` (engine/trainer/draft/fp8.py) the backward of ``down(silu(gate(m)) * up(m))``
turns the gradient ``dh`` that down's grad_input GEMM writes into gate's and up's output gradients (``dg``, ``du``:
silu's backward), and quantises each twice: per token along the features (grad_input's operand, row-major) and per
feature along the tokens (grad_weight's, written transposed: e4m3 GEMMs take K-major operands). In the whole
engine's profile (session 23, one H100, batch 4) inductor's fused kernel for this took 1.95 ms a TTT step, about
4.6x the memory floor of what it reads and writes. Each way here computes the same eight tensors from the same
``dh``, gate and up outputs (M tokens x N features, bf16), compiled as the engine compiles its step:

  engine        the engine's expressions (``fp8.quantize_rows`` on the gradient and on its padded transpose)
  split_amax    the per-feature maxima as two reductions (blocks of tokens, then the blocks), the transposed
                quantisation written row-major then transposed as e4m3 (1 byte an element, not the bf16 input)
  two_graphs    silu's backward in one compiled graph (dg, du written in bf16), the quantisations in another:
                what un-fusing them costs or saves
  triton        (CUDA) one kernel for both maxima of both gradients (atomic max per tile), the scales as the
                engine rounds them, one kernel writing the four e4m3 layouts

Each way is checked against the engine's (compiled): the share of scales that differ (powers of two: a maximum in
fp32 or rounded to bf16 first can cross one) and the largest difference of the dequantised values in units of a
row's range (e4m3's rounding alone keeps it within 32/448 = 0.071, half its top step at twice the scale); the
eager engine expressions are compared the same way, for scale. The floor is the bytes read and written once (three
bf16 inputs, four e4m3 outputs) at the bandwidth a device-to-device copy reaches here.

    python3 tests/bench/bench_quant.py [--tokens 8192 --features 14336] [--out DIR]   (one GPU; ~1-2 minutes)
    python3 tests/bench/bench_quant.py --dry-run                                      (the CPU, small shapes)
    TRITON_INTERPRET=1 python3 tests/bench/bench_quant.py --dry-run          (with Triton installed: its way too)

One ``RESULT {json}`` line; each way's line first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.trainer.draft import fp8  # noqa: E402

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch: the dry run leaves the Triton way out
    triton = None

Outputs = tuple[torch.Tensor, ...]  # for dg then du: rows, row_scale, cols, col_scale
SPLIT_BLOCK = 64  # split_amax: tokens per first-stage block


def silu_grads(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dg, du) of ``silu(g) * u`` for the incoming gradient dh, as autograd's decomposition computes them."""
    du = dh * F.silu(g)
    dg = torch.ops.aten.silu_backward(dh * u, g)
    return dg, du


def engine_quant(x: torch.Tensor) -> Outputs:
    rows, row_scale = fp8.quantize_rows(x)
    cols, col_scale = fp8.quantize_rows(fp8._pad_tokens(x.t()))
    return rows, row_scale, cols, col_scale


def engine_way(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> Outputs:
    dg, du = silu_grads(dh, g, u)
    return (*engine_quant(dg), *engine_quant(du))


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    amax = amax.float().clamp_min(fp8.AMAX_FLOOR)
    return torch.exp2(torch.ceil(torch.log2(amax / fp8.E4M3_MAX)))


def split_quant(x: torch.Tensor) -> Outputs:
    rows, row_scale = fp8.quantize_rows(x)
    m, n = x.shape
    pad = -m % SPLIT_BLOCK
    blocks = F.pad(x, (0, 0, 0, pad)).view(-1, SPLIT_BLOCK, n)
    amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=1).amax(dim=0)  # (n,)
    col_scale = _pow2_scale(amax).unsqueeze(0)  # (1, n)
    q = (x.float() / col_scale).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn)
    cols = fp8._pad_tokens(q.t().view(torch.uint8)).view(torch.float8_e4m3fn).contiguous()
    return rows, row_scale, cols, col_scale.t()


def split_way(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> Outputs:
    dg, du = silu_grads(dh, g, u)
    return (*split_quant(dg), *split_quant(du))


if triton is not None:

    @triton.jit
    def _grads(dh_ptr, g_ptr, u_ptr, offs, mask):
        dh = tl.load(dh_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        # rounded to bf16 as the engine's gradients are before they are quantised
        du = (dh * (g * s)).to(tl.bfloat16).to(tl.float32)
        dg = ((dh * u).to(tl.bfloat16).to(tl.float32) * (s * (1.0 + g * (1.0 - s)))).to(tl.bfloat16).to(tl.float32)
        return dg, du

    @triton.jit
    def _amax_kernel(dh_ptr, g_ptr, u_ptr, dg_row, dg_col, du_row, du_col, M, N, BM: tl.constexpr, BN: tl.constexpr):
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None] * N + rn[None, :]
        dg, du = _grads(dh_ptr, g_ptr, u_ptr, offs, mask)
        dg, du = tl.abs(dg), tl.abs(du)
        tl.atomic_max(dg_row + rm, tl.max(dg, 1), mask=rm < M)
        tl.atomic_max(du_row + rm, tl.max(du, 1), mask=rm < M)
        tl.atomic_max(dg_col + rn, tl.max(dg, 0), mask=rn < N)
        tl.atomic_max(du_col + rn, tl.max(du, 0), mask=rn < N)

    @triton.jit
    def _store_quant(grad, rs_ptr, cs_ptr, rows_ptr, cols_ptr, rm, rn, offs, offs_t, mask, mask_t, M, N):
        rs = tl.load(rs_ptr + rm, mask=rm < M, other=1.0)
        cs = tl.load(cs_ptr + rn, mask=rn < N, other=1.0)
        tl.store(rows_ptr + offs, tl.clamp(grad / rs[:, None], -448.0, 448.0).to(tl.float8e4nv), mask=mask)
        tl.store(cols_ptr + offs_t, tl.clamp(grad / cs[None, :], -448.0, 448.0).to(tl.float8e4nv), mask=mask_t)

    @triton.jit
    def _quant_kernel(
        dh_ptr, g_ptr, u_ptr, dg_rs, dg_cs, du_rs, du_cs, dg_rows, dg_cols, du_rows, du_cols, M, N, MP,
        BM: tl.constexpr, BN: tl.constexpr,
    ):  # fmt: skip
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        offs = rm[:, None] * N + rn[None, :]
        offs_t = rn[None, :] * MP + rm[:, None]  # (N, MP) transposed, MP: M padded with zero tokens
        mask_t = (rm[:, None] < MP) & (rn[None, :] < N)
        dg, du = _grads(dh_ptr, g_ptr, u_ptr, offs, mask)
        _store_quant(dg, dg_rs, dg_cs, dg_rows, dg_cols, rm, rn, offs, offs_t, mask, mask_t, M, N)
        _store_quant(du, du_rs, du_cs, du_rows, du_cols, rm, rn, offs, offs_t, mask, mask_t, M, N)


def triton_way(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor, bm: int = 64, bn: int = 128) -> Outputs:
    """The hand-written way: one kernel for both maxima of both gradients (an atomic max per tile and row or
    column), the scales as the engine rounds them, one kernel writing the four e4m3 layouts."""
    m, n = dh.shape
    mp = m + (-m % fp8.MATMUL_ALIGN)
    amax = torch.zeros(2 * (m + n), device=dh.device, dtype=torch.float32)
    dg_row, dg_col, du_row, du_col = amax.split([m, n, m, n])
    grid = (triton.cdiv(mp, bm), triton.cdiv(n, bn))
    _amax_kernel[grid](dh, g, u, dg_row, dg_col, du_row, du_col, m, n, BM=bm, BN=bn)
    dg_rs, dg_cs, du_rs, du_cs = (_pow2_scale(a) for a in (dg_row, dg_col, du_row, du_col))
    e4m3 = torch.float8_e4m3fn
    dg_rows, du_rows = (torch.empty(m, n, device=dh.device, dtype=e4m3) for _ in range(2))
    dg_cols, du_cols = (torch.empty(n, mp, device=dh.device, dtype=e4m3) for _ in range(2))
    _quant_kernel[grid](
        dh, g, u, dg_rs, dg_cs, du_rs, du_cs, dg_rows, dg_cols, du_rows, du_cols, m, n, mp, BM=bm, BN=bn
    )
    return (dg_rows, dg_rs.unsqueeze(1), dg_cols, dg_cs.unsqueeze(1),
            du_rows, du_rs.unsqueeze(1), du_cols, du_cs.unsqueeze(1))  # fmt: skip


def compare(ref: Outputs, got: Outputs) -> dict[str, Any]:
    """How far ``got`` is from ``ref``: the share of scales that differ (a gradient's maximum computed in fp32 or
    rounded to bf16 first can cross a power of two), and the largest difference of the dequantised values
    (``q * scale``) in units of each row's range (``448 * scale``): e4m3's rounding alone keeps it within 32/448
    (half of its top step, at twice the scale)."""
    out: dict[str, Any] = {"scales_differ_share": 0.0, "dequantised_max_diff": 0.0}
    for i in range(0, len(ref), 2):
        q_ref, s_ref, q_got, s_got = ref[i], ref[i + 1].float(), got[i], got[i + 1].float()
        if s_ref.shape != s_got.shape or q_ref.shape != q_got.shape:
            raise ValueError(f"output {i}: shapes {tuple(q_got.shape)}/{tuple(s_got.shape)} "
                             f"against {tuple(q_ref.shape)}/{tuple(s_ref.shape)}")  # fmt: skip
        out["scales_differ_share"] = max(out["scales_differ_share"], float((s_ref != s_got).float().mean()))
        diff = (q_ref.float() * s_ref - q_got.float() * s_got).abs() / (fp8.E4M3_MAX * s_ref)
        out["dequantised_max_diff"] = max(out["dequantised_max_diff"], float(diff.max()))
    return out


def timed(fn: Callable[[], object], warm: int, iters: int, device: torch.device) -> float:
    """Median ms of ``iters`` calls after ``warm`` (CUDA events on a GPU, wall time on the CPU)."""
    for _ in range(warm):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="M: batch x sequence (8192: batch 4 x 2048)")
    ap.add_argument("--features", type=int, default=14336, help="N: the MLP's intermediate size (the 8B's)")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dry-run", action="store_true", help="the CPU at small shapes: the code path, not a figure")
    ap.add_argument("--out", type=Path, default=None, help="write quant.json here")
    a = ap.parse_args(argv)
    if a.dry_run:
        device, m, n, a.warm, a.iters = torch.device("cpu"), 200, 96, 1, 2
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run on a GPU, or --dry-run on the CPU", file=sys.stderr)
            return 2
        device, m, n = torch.device("cuda"), a.tokens, a.features
    gen = torch.Generator(device=device).manual_seed(0)
    dh, g, u = (torch.randn(m, n, device=device, generator=gen).mul_(s).bfloat16() for s in (1e-3, 2.0, 1.0))
    dh[: m // 7] *= 1e-3  # rows of other magnitudes: the per-row and per-column scales differ
    compile_ = torch.compile
    ways: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], Outputs]] = {
        "engine": compile_(engine_way),
        "split_amax": compile_(split_way),
    }
    grads_c, quant_c = compile_(silu_grads), compile_(lambda x, y: (*engine_quant(x), *engine_quant(y)))
    ways["two_graphs"] = lambda dh, g, u: quant_c(*grads_c(dh, g, u))
    if triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        ways["triton"] = triton_way
    t0 = time.perf_counter()
    reference = ways["engine"](dh, g, u)  # the engine's step as compiled: what each way is held to
    engine_first_s = time.perf_counter() - t0
    result_eager = compare(reference, engine_way(dh, g, u))
    # the floor: three bf16 inputs read and four e4m3 layouts written once, at a device copy's bandwidth
    big = torch.empty(3 * m * n, device=device, dtype=torch.bfloat16)
    copy_ms = timed(lambda: big.clone(), a.warm, a.iters, device)
    bytes_moved = 3 * m * n * 2 + 4 * m * n
    gbps = 2 * big.numel() * 2 / (copy_ms * 1e-3) / 1e9
    floor_ms = bytes_moved / (gbps * 1e9) * 1e3
    result: dict[str, Any] = {"tokens": m, "features": n, "device": str(device), "copy_gb_s": round(gbps, 1),
                              "floor_ms": round(floor_ms, 4), "dry_run": a.dry_run, "eager_engine": result_eager,
                              "ways": {}}  # fmt: skip
    for name, fn in ways.items():
        t0 = time.perf_counter()
        try:
            got = fn(dh, g, u)
            compile_s = engine_first_s if name == "engine" else time.perf_counter() - t0
            check = compare(reference, got)
            ms = timed(lambda fn=fn: fn(dh, g, u), a.warm, a.iters, device)  # type: ignore[misc]
        except Exception as e:  # one way's failure (a Triton compile error) is its row, not the run's
            result["ways"][name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{name:>11}: failed: {type(e).__name__}: {str(e)[:600]}", flush=True)
            continue
        result["ways"][name] = {"ms": round(ms, 4), "x_floor": round(ms / floor_ms, 2),
                                "first_call_s": round(compile_s, 1), **check}  # fmt: skip
        print(f"{name:>11}: {ms:8.3f} ms ({ms / floor_ms:.1f}x the floor {floor_ms:.3f} ms), against the engine's: "
              f"scales differing {check['scales_differ_share']:.1e}, dequantised max diff "
              f"{check['dequantised_max_diff']:.3f} of a row's range; first call {compile_s:.1f} s",
              flush=True)  # fmt: skip
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "quant.json").write_text(json.dumps(result, indent=1))
    print(f"eager engine against compiled: scales differing {result_eager['scales_differ_share']:.1e}, dequantised "
          f"max diff {result_eager['dequantised_max_diff']:.3f}")  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
