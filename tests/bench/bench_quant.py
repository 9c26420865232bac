"""The FP8 drafter's costliest non-GEMM kernel, timed alone: the backward's quantisation of the MLP gradient.

With ``drafter_fp8 = "rowwise"`` (engine/trainer/draft/fp8.py) the backward of ``down(silu(gate(m)) * up(m))``
turns the gradient ``dh`` that down's grad_input GEMM writes into gate's and up's output gradients (``dg``, ``du``:
silu's backward), and quantises each twice: per token along the features (grad_input's operand, row-major) and per
feature along the tokens (grad_weight's, written transposed: e4m3 GEMMs take K-major operands). In the whole
engine's profile (session 23, one H100, batch 4) inductor's fused kernel for this took 1.95 ms a TTT step, about
4.6x the memory floor of what it reads and writes. Each way here computes the same eight tensors from the same
``dh``, gate and up outputs (M tokens x N features, bf16), compiled as the engine compiles its step:

  engine        the expressions the composed Linears run (``fp8.quantize_rows`` on each gradient and on its padded
                transpose), fused by inductor as in the step (drafter_fp8_mlp = "composed", the default)
  split_amax    the per-feature maxima as two reductions (blocks of tokens, then the blocks), the transposed
                quantisation written row-major then transposed as e4m3 (1 byte an element, not the bf16 input)
  two_graphs    silu's backward in one compiled graph (dg, du written in bf16), the quantisations in another:
                what un-fusing them costs or saves
  triton_BMxBN  (CUDA) the engine's op under drafter_fp8_mlp = "fused" (draft/fp8_mlp_triton.py):
                one kernel for both maxima of both gradients (an atomic max per tile), the scales as quantize_rows
                rounds them, one kernel writing the four e4m3 layouts; per tile shape (tokens x features)
  engine_op     the op as the compiled step calls it (``specdec::fp8_gated_grads``, the 64x128 tile)

Each way is checked against the engine's (compiled): the share of scales that differ (powers of two: a maximum in
fp32 or rounded to bf16 first can cross one) and the largest difference of the dequantised values in units of a
row's range (e4m3's rounding alone keeps it within 32/448 = 0.071, half its top step at twice the scale); the
eager engine expressions are compared the same way, for scale. Each way is also held to those eager expressions
(``against_eager``): the op's kernels round where eager autograd does, so there they should agree to e4m3's
rounding with (nearly) every scale equal; tests/device/run's fused-MLP item checks that. The floor is the bytes
read and written once (three bf16 inputs, four e4m3 outputs) at the bandwidth a device-to-device copy reaches here.

    python3 tests/bench/bench_quant.py [--tokens 8192 --features 14336 --hidden 4096] [--out DIR]   (one GPU; ~1-2 min)
    python3 tests/bench/bench_quant.py --dry-run                                      (the CPU, small shapes)
    TRITON_INTERPRET=1 python3 tests/bench/bench_quant.py --dry-run          (with Triton installed: its way too)

Then the whole node (``time_the_node``), forward and backward compiled, composed against fused: each one's ms and
the fused one's relative distance from the composed one (output, input and weight gradients).

One ``RESULT {json}`` line; each way's line first.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine.trainer.draft import fp8, fp8_mlp  # noqa: E402

sys.path.insert(0, str(REPO / "tests" / "bench"))  # bench_kernels: its timer
from bench_kernels import timer  # noqa: E402

TILES = ((64, 128), (128, 64), (32, 256), (64, 64))  # the Triton way's (tokens, features) tiles timed

Outputs = tuple[torch.Tensor, ...]  # for dg then du: rows, row_scale, cols, col_scale
SPLIT_BLOCK = 64  # split_amax: tokens per first-stage block


silu_grads = fp8_mlp.silu_mul_grads
engine_quant = fp8_mlp.quantize_both


def engine_way(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> Outputs:
    """The composed backward's expressions (two FP8 Linears under autograd's silu * up), compiled by the caller."""
    dg, du = silu_grads(dh, g, u)
    return (*engine_quant(dg), *engine_quant(du))


def split_quant(x: torch.Tensor) -> Outputs:
    rows, row_scale = fp8.quantize_rows(x)
    m, n = x.shape
    pad = -m % SPLIT_BLOCK
    blocks = F.pad(x, (0, 0, 0, pad)).view(-1, SPLIT_BLOCK, n)
    amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=1).amax(dim=0)  # (n,)
    col_scale = fp8.pow2_scales(amax.float()).unsqueeze(0)  # (1, n)
    q = (x.float() / col_scale).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn)
    cols = fp8._pad_tokens(q.t().view(torch.uint8)).view(torch.float8_e4m3fn).contiguous()
    return rows, row_scale, cols, col_scale.t()


def split_way(dh: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> Outputs:
    dg, du = silu_grads(dh, g, u)
    return (*split_quant(dg), *split_quant(du))


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


def time_the_node(m: int, n: int, h: int, warm: int, iters: int, device: torch.device) -> dict[str, Any]:
    """The whole MLP input node, forward and backward, compiled: the two FP8 Linears under autograd's silu * up
    ("composed", the engine's default) against the one node (``drafter_fp8_mlp = "fused"``), on the same m (M x H)
    and gate/up weights (N x H, bf16, their layouts made once as the engine makes them a step). Each way's ms, and
    how far the fused way's output and gradients are from the composed way's (relative error norms)."""
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(m, h, device=device, generator=gen).bfloat16()
    wg, wu = (torch.randn(n, h, device=device, generator=gen).mul_(0.02).bfloat16() for _ in range(2))
    dout = torch.randn(m, n, device=device, generator=gen).mul_(1e-3).bfloat16()
    layouts = fp8.weight_layouts({"g": wg, "u": wu})
    if device.type == "cuda":
        fp8_mlp.register_cuda_kernels()

    def node(fused: bool) -> Callable[..., torch.Tensor]:
        def forward(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor) -> torch.Tensor:
            gate = fp8.Fp8Weight(wg, *layouts["g"], grad_weight_fp8=True, fused_mlp=fused)
            up = fp8.Fp8Weight(wu, *layouts["u"], grad_weight_fp8=True, fused_mlp=fused)
            if fused:
                return fp8_mlp.fp8_gated_mlp(x, gate, up)
            return F.silu(fp8.fp8_linear(x, gate)) * fp8.fp8_linear(x, up)

        return torch.compile(forward)

    def run(fn: Callable[..., torch.Tensor]) -> tuple[torch.Tensor, ...]:
        xr, wgr, wur = (t.detach().requires_grad_() for t in (x, wg, wu))
        out = fn(xr, wgr, wur)
        out.backward(dout)
        assert xr.grad is not None and wgr.grad is not None and wur.grad is not None
        return out.detach(), xr.grad, wgr.grad, wur.grad

    res: dict[str, Any] = {"tokens": m, "features": n, "hidden": h}
    outs = {}
    for way, fused in (("composed", False), ("fused", True)):
        fn = node(fused)
        try:
            outs[way] = run(fn)
            res[f"{way}_ms"] = round(timer(device)(lambda fn=fn: run(fn), warm, iters), 4)  # type: ignore[misc]
        except Exception as e:  # a way that fails is its row
            res[f"{way}_error"] = f"{type(e).__name__}: {e}"[:2000]
    if len(outs) == 2:
        res["fused_rel_err"] = {
            name: round(float((f.float() - c.float()).norm() / c.float().norm().clamp_min(1e-30)), 6)
            for name, c, f in zip(
                ("out", "grad_m", "grad_gate", "grad_up"), outs["composed"], outs["fused"], strict=True
            )
        }
    print(f"node (M {m}, N {n}, H {h}), forward and backward compiled: composed {res.get('composed_ms')} ms, fused "
          f"{res.get('fused_ms')} ms; fused against composed (relative) {res.get('fused_rel_err')}"
          + "".join(f"; {k}: {v[:300]}" for k, v in res.items() if k.endswith("_error")), flush=True)  # fmt: skip
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="M: batch x sequence (8192: batch 4 x 2048)")
    ap.add_argument("--features", type=int, default=14336, help="N: the MLP's intermediate size (the 8B's)")
    ap.add_argument("--hidden", type=int, default=4096, help="H: the node's input size (the 8B's)")
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
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        try:
            from engine.trainer.draft import fp8_mlp_triton
        except ImportError as exc:
            print(f"no Triton ({exc}): the Triton ways left out", flush=True)
        else:
            for tile in TILES:  # the engine's kernels (fp8_mlp_triton.triton_gated_grads), called directly
                ways[f"triton_{tile[0]}x{tile[1]}"] = functools.partial(fp8_mlp_triton.triton_gated_grads, tile=tile)
            if device.type == "cuda":  # the op as the compiled step calls it, its CUDA kernels registered
                fp8_mlp.register_cuda_kernels()
                ways["engine_op"] = torch.compile(lambda dh, g, u: fp8_mlp.gated_grads(dh, g, u))
    t0 = time.perf_counter()
    reference = ways["engine"](dh, g, u)  # the engine's step as compiled: what each way is held to
    engine_first_s = time.perf_counter() - t0
    eager = engine_way(dh, g, u)  # the same expressions uncompiled: what the op's kernels round as (autograd's bf16)
    result_eager = compare(reference, eager)
    # the floor: three bf16 inputs read and four e4m3 layouts written once, at a device copy's bandwidth
    big = torch.empty(3 * m * n, device=device, dtype=torch.bfloat16)
    copy_ms = timer(device)(lambda: big.clone(), a.warm, a.iters)
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
            check = {**compare(reference, got), "against_eager": compare(eager, got)}
            ms = timer(device)(lambda fn=fn: fn(dh, g, u), a.warm, a.iters)  # type: ignore[misc]
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
    result["node"] = time_the_node(m, n, a.hidden if not a.dry_run else 64, a.warm, a.iters, device)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "quant.json").write_text(json.dumps(result, indent=1))
    print(f"eager engine against compiled: scales differing {result_eager['scales_differ_share']:.1e}, dequantised "
          f"max diff {result_eager['dequantised_max_diff']:.3f}")  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
