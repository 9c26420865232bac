"""The fused FP8 MLP's Triton kernels (engine/trainer/draft/fp8_mlp_triton.py) checked without a GPU, with the Triton
a GPU host's torch ships (tests/interop/triton_site.py installs it beside this interpreter's torch):

    python3 tests/interop/triton_kernels.py compile      both kernels at bench_quant.py's four tiles compiled to an
                                                          sm_90 cubin (an H100 or H200) by Triton's own compiler and
                                                          ptxas: what a first launch on the GPU does before it runs
    TRITON_INTERPRET=1 python3 tests/interop/triton_kernels.py interpret
                                                          the kernels run by Triton's interpreter on CPU tensors,
                                                          against the op's eager expressions

One ``RESULT {json}`` line. The interpreter casts float32 to bf16 by truncation where a GPU rounds to nearest (and
takes numpy's sigmoid), so a gradient can land one bf16 step lower than eager's, and with it a row's maximum and
scale a power of two apart, and its float32-to-e4m3 cast is coarser than e4m3's rounding (-127 comes out -64, not
-128). So the interpret check holds the scales (a few a power of two apart at most), the layouts' shapes, each value's
sign and its size within the interpreter's cast, zeros in the padding tokens' columns and a non-finite gradient's
row and column given an infinite scale; tests/device/run's item 7 holds the GPU's kernels to eager's rounding.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: engine/
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # bench_quant's TILES


def compile_kernels() -> dict[str, object]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from engine.trainer.draft import fp8_mlp_triton as k

    bf16, f32, e4m3 = "*bf16", "*fp32", "*fp8e4nv"
    ins = {"dh_ptr": bf16, "g_ptr": bf16, "u_ptr": bf16, "amax_ptr": f32}
    signatures = {
        "_amax_kernel": {**ins, "M": "i32", "N": "i32", "BM": "constexpr", "BN": "constexpr"},
        "_layouts_kernel": {
            **ins, "dg_rs": f32, "dg_cs": f32, "du_rs": f32, "du_cs": f32,
            "dg_rows": e4m3, "dg_cols": e4m3, "du_rows": e4m3, "du_cols": e4m3,
            "M": "i32", "N": "i32", "MP": "i32", "BM": "constexpr", "BN": "constexpr",
        },
    }  # fmt: skip
    target = GPUTarget("cuda", 90, 32)
    out: dict[str, object] = {"triton": triton.__version__, "target": "cuda sm_90", "kernels": {}}
    from bench_quant import TILES  # the tiles the device bench times

    for tile in TILES:
        for name, signature in signatures.items():
            t0 = time.perf_counter()
            src = ASTSource(fn=getattr(k, name), signature=signature, constexprs={"BM": tile[0], "BN": tile[1]})
            try:
                compiled = triton.compile(src, target=target)
            except Exception as exc:  # the record names the kernel and Triton's whole chain of causes
                chain, cause = [], exc
                while cause is not None:
                    chain.append(f"{type(cause).__name__}: {str(cause)[-800:]}")
                    cause = cause.__cause__
                out["kernels"][f"{name} {tile[0]}x{tile[1]}"] = {"error": chain}  # type: ignore[index]
                continue
            out["kernels"][f"{name} {tile[0]}x{tile[1]}"] = {  # type: ignore[index]
                "cubin_bytes": len(compiled.asm["cubin"]),
                "shared": compiled.metadata.shared,
                "s": round(time.perf_counter() - t0, 2),
            }
    return out


def interpret_kernels() -> dict[str, object]:
    from engine.trainer.draft import fp8_mlp, fp8_mlp_triton

    torch.manual_seed(0)
    m, n = 200, 96  # tokens not a multiple of 16 (padding columns) nor of any tile; features not of 128
    dh = torch.randn(m, n, dtype=torch.bfloat16) * 0.01
    g = torch.randn(m, n, dtype=torch.bfloat16) * 2
    u = torch.randn(m, n, dtype=torch.bfloat16)
    nan_at = (37, 11)
    dh[nan_at] = float("nan")
    reference = fp8_mlp._gated_grads_reference(dh, g, u)
    result: dict[str, object] = {"tokens": m, "features": n, "tiles": {}}
    for tile in ((64, 128), (32, 256)):
        got = fp8_mlp_triton.triton_gated_grads(dh, g, u, tile=tile)
        result["tiles"][f"{tile[0]}x{tile[1]}"] = [  # type: ignore[index]
            _compare_layouts(got[i : i + 4], reference[i : i + 4], m, nan_at) for i in (0, 4)
        ]
    return result


def _compare_layouts(
    got: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...], m: int, nan_at: tuple[int, int]
) -> dict[str, object]:
    """One gradient's four layouts against the reference's: what is checked is returned, the test asserts it."""
    rows, rs, cols, cs = got
    ref_rows, ref_rs, ref_cols, ref_cs = ref
    r, c = nan_at
    finite_r = torch.ones(rs.shape[0], dtype=torch.bool)
    finite_r[r] = False
    finite_c = torch.ones(cs.shape[0], dtype=torch.bool)
    finite_c[c] = False
    mp = cols.shape[1]
    out: dict[str, object] = {
        "shapes": [list(t.shape) for t in got] == [list(t.shape) for t in ref],
        "dtypes": [str(t.dtype) for t in got],
        "padding_zero": bool((cols[:, m:].float() == 0).all()) if mp > m else None,
        "padding_columns": mp - m,
        "nan_row_scale": rs[r].item(),
        "nan_col_scale": cs[c].item(),
        "other_scales_finite": bool(torch.isfinite(rs[finite_r]).all() and torch.isfinite(cs[finite_c]).all()),
        "scales_pow2": bool(
            all((torch.log2(s[ok]) == torch.log2(s[ok]).round()).all() for s, ok in ((rs, finite_r), (cs, finite_c)))
        ),
    }
    differ = torch.cat([(rs != ref_rs)[finite_r], (cs != ref_cs)[finite_c]])
    ratio = torch.cat([(rs / ref_rs)[finite_r], (cs / ref_cs)[finite_c]])
    out["scales_differ_share"] = differ.float().mean().item()
    out["scale_ratios"] = sorted({float(x) for x in ratio.flatten().tolist()})
    # dequantised, on the finite rows (per token) and the finite features (per feature, the real tokens)
    deq_rows = (rows.float() * rs)[finite_r][:, finite_c]
    ref_deq_rows = (ref_rows.float() * ref_rs)[finite_r][:, finite_c]
    range_rows = ref_deq_rows.abs().amax(1, keepdim=True).clamp_min(1e-30)
    deq_cols = (cols[:, :m].float() * cs)[finite_c][:, finite_r]
    ref_deq_cols = (ref_cols[:, :m].float() * ref_cs)[finite_c][:, finite_r]
    range_cols = ref_deq_cols.abs().amax(1, keepdim=True).clamp_min(1e-30)
    out["rows_max_diff"] = ((deq_rows - ref_deq_rows).abs() / range_rows).max().item()
    out["cols_max_diff"] = ((deq_cols - ref_deq_cols).abs() / range_cols).max().item()
    # placement: each e4m3 value has the reference's sign and is within the interpreter's coarse cast of it (it gives
    # -127 as -64, where e4m3 rounds to -128): a value from another token or feature would not be
    q_pairs = (
        (rows.float()[finite_r][:, finite_c], ref_rows.float()[finite_r][:, finite_c]),
        (cols[:, :m].float()[finite_c][:, finite_r], ref_cols[:, :m].float()[finite_c][:, finite_r]),
    )
    signs, ratios = [], []
    for q, ref_q in q_pairs:
        big = ref_q.abs() >= 1.0  # values below e4m3's normal range are left to the difference above
        signs.append((torch.sign(q[big]) == torch.sign(ref_q[big])).float().mean().item())
        ratios += [(q[big] / ref_q[big]).min().item(), (q[big] / ref_q[big]).max().item()]
    out["sign_agreement"] = min(signs)
    out["value_ratio_range"] = [min(ratios), max(ratios)]
    return out


def main(argv: list[str]) -> int:
    mode = argv[0] if argv else ""
    if mode == "compile":
        result = compile_kernels()
    elif mode == "interpret":
        result = interpret_kernels()
    else:
        print("usage: triton_kernels.py compile|interpret", file=sys.stderr)
        return 2
    print("RESULT " + json.dumps(result))  # an infinite scale is written as Infinity, which json reads back
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
