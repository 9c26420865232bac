"""The fused FP8 MLP's Triton kernels (engine/trainer/draft/fp8_mlp_triton.py) on this CPU, with the Triton the GPU
hosts' torch ships (triton_site.py): compiled to an sm_90 cubin as a first launch on an H100 compiles them, and run by
Triton's interpreter against the op's eager expressions (tests/interop/triton_kernels.py says what that can hold).
A kernel that does not compile once failed the device suite's item 7 on an H100 with nothing in CI to catch it.
Skipped only when the package registry cannot serve the wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from triton_site import RegistryUnreachable, ensure_site  # beside this file (pytest puts its dir on sys.path)

SCRIPT = Path(__file__).with_name("triton_kernels.py")


def run_check(mode: str, tmp_path: Path, interpret: bool = False) -> dict:
    try:
        site = ensure_site()
    except RegistryUnreachable as exc:
        pytest.skip(f"the package registry is unreachable, so Triton cannot be installed: {exc}")
    env = {**os.environ, "PYTHONPATH": str(site), "TRITON_CACHE_DIR": str(tmp_path / "triton-cache")}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), mode], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def test_both_kernels_compile_to_an_sm90_cubin_at_every_tile_the_bench_times(tmp_path: Path) -> None:
    r = run_check("compile", tmp_path)
    assert r["triton"] == "3.6.0" and r["target"] == "cuda sm_90"
    kernels = r["kernels"]
    assert sorted(kernels) == sorted(
        f"{name} {t}" for name in ("_amax_kernel", "_layouts_kernel") for t in ("64x128", "128x64", "32x256", "64x64")
    )
    failed = {k: v["error"] for k, v in kernels.items() if "error" in v}
    assert not failed, json.dumps(failed, indent=1)
    for record in kernels.values():
        assert record["cubin_bytes"] > 10_000
        assert record["shared"] <= 227 * 1024  # an H100's shared memory a block


def test_the_interpreted_kernels_place_scale_and_flag_as_the_eager_op_does(tmp_path: Path) -> None:
    r = run_check("interpret", tmp_path, interpret=True)
    assert r["tokens"] == 200 and r["features"] == 96
    for tile, grads in r["tiles"].items():
        assert len(grads) == 2, tile
        for which, c in zip(("dg", "du"), grads, strict=True):
            where = f"{tile} {which}"
            assert c["shapes"] is True, where
            assert c["dtypes"] == ["torch.float8_e4m3fn", "torch.float32"] * 2, where
            assert c["padding_columns"] == 8 and c["padding_zero"] is True, where
            # dh's NaN: its token's row and its feature's column quantised with an infinite scale, the rest finite
            assert c["nan_row_scale"] == float("inf") and c["nan_col_scale"] == float("inf"), where
            assert c["other_scales_finite"] is True and c["scales_pow2"] is True, where
            # the interpreter's bf16 truncation can put a maximum one step low: a few scales a power of two apart
            assert c["scales_differ_share"] <= 0.05, where
            assert set(c["scale_ratios"]) <= {0.5, 1.0, 2.0}, where
            assert c["sign_agreement"] == 1.0, where
            low, high = c["value_ratio_range"]
            assert low >= 0.45 and high <= 2.3, where
