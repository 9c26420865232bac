"""tests/device/run's item 7, the fused FP8 MLP: reads tests/bench/bench_quant.py's quant.json and prints one PASS or
FAIL line, then the timings as a # line where both timed ways ran.

    python3 tests/device/quant_check.py OUT/quant/quant.json [DRY]    (DRY "1": a CPU dry run, where no kernel need run)

PASS when every Triton way and the op as the compiled step calls it round where eager autograd does (at most 0.1 % of
the scales differ, the dequantised values within e4m3's rounding, 32/448 of a row's range) and the whole node,
compiled, is fused against composed within 5 % (relative norm) on the output and the three gradients, all finite. On
a GPU, kernels that did not run are a FAIL. Exit 0 on PASS, 1 on FAIL or on no readable record.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any


def verdict(r: dict[str, Any], dry: bool) -> tuple[bool, list[str]]:
    """(ok, lines): the PASS or FAIL line, then the timing line where both timed ways ran."""
    ways, node = r["ways"], r["node"]
    bad = []
    kernels = [w for w in ways if w == "engine_op" or w.startswith("triton_")]
    if not dry and "engine_op" not in kernels:
        bad.append("the op's CUDA kernels did not run")
    for w in kernels:  # the kernels round where eager autograd does: e4m3's rounding apart, the same tensors
        c = ways[w].get("against_eager")
        if c is None:
            bad.append(f"{w}: {ways[w].get('error', 'no result')[:200]}")
        elif not (c["scales_differ_share"] <= 1e-3 and c["dequantised_max_diff"] <= 32 / 448 + 1e-6):
            bad.append(
                f"{w}: scales differing {c['scales_differ_share']:.1e}, dequantised {c['dequantised_max_diff']:.3f}"
            )
    errs = node.get("fused_rel_err") or {}
    if len(errs) != 4 or not all(math.isfinite(e) and e < 0.05 for e in errs.values()):
        bad.append(f"node: fused against composed {errs or node}")
    worst = max(errs.values(), default=float("nan"))
    seen = ", ".join(kernels) or "no Triton here: the kernels not run"
    lines = [
        f"{'FAIL' if bad else 'PASS'} fused FP8 MLP ({seen}): node fused vs composed worst {worst:.1e}"
        + "".join(f"; {b}" for b in bad)
    ]
    if "ms" in ways.get("engine_op", {}) and "ms" in ways.get("engine", {}):
        lines.append(
            f"#   quantisation {ways['engine']['ms']:.3f} ms composed, {ways['engine_op']['ms']:.3f} ms the op "
            f"(floor {r['floor_ms']:.3f}); node {node.get('composed_ms')} ms composed, {node.get('fused_ms')} ms fused"
        )
    return not bad, lines


def main(argv: list[str]) -> int:
    try:
        r = json.loads(Path(argv[0]).read_text())
        ok, lines = verdict(r, dry=len(argv) > 1 and argv[1] == "1")
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        print(f"FAIL fused FP8 MLP: no result ({exc!r}; see quant.txt)")
        return 1
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
