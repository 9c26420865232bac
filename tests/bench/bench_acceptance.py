"""Acceptance length τ of drafters trained by the engine on the built-in trained target (CPU).

    python3 tests/bench/bench_acceptance.py [--steps 300] [--variants rope0-old,rope1-new] [--k 5] [--seeds 0,1]
        [--out FILE]

For each variant the engine (``python3 -m engine.trainer --preset cpu-demo --set ...``) trains one drafter
on ``tiny-trained`` for ``--steps`` steps, and ``specdec-train eval`` measures τ on the held-out prompts;
the untrained τ is the same drafter after one step at a learning rate of 1e-30 (its initial weights).
Each trained drafter is measured twice: with the conventions it was trained with (a self-consistent chain),
and ``--as-served`` (rotary positions advancing per draft token and the outputs of layers 1, L/2-1, L-4,
as vLLM and SGLang feed a drafter by default): the second shows what the old conventions cost when served.
Variants toggle the two serve-time conventions: ``rope0``/``rope1`` = ``ttt_rope_offset`` false/true
(rotary positions advancing with the TTT step; a variant that sets it is skipped where the config has no such
key), ``old``/``new`` = ``target_layers`` (2, L/2, L-3) vs (1, L/2-1, L-4) (outputs captured). A third part
``-fp8`` trains against the FP8 target (``target_fp8``); its τ is still measured with the exact target, as a
server runs it, so ``rope1-new`` vs ``rope1-new-fp8`` is what training on the FP8 target costs when served.
``--seeds`` trains each variant once per seed (the drafter's initial weights and the data order): the spread
between seeds of one variant is the noise a difference between variants is judged against. Each τ is printed
with its standard error over rounds (from the accepted-length histogram), and each ``-fp8`` variant is put beside
its exact-target twin, seed by seed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from engine.trainer.config import TrainerConfig  # noqa: E402
from engine.trainer.verifier.builtin import DEFAULT_RECIPE, ensure_built, read_metrics  # noqa: E402

LAYERS = DEFAULT_RECIPE.layers
LAYER_SETS: dict[str, list[int]] = {
    "old": [2, LAYERS // 2, LAYERS - 3],  # the first engine's inputs-of-layers reading
    "new": [1, LAYERS // 2 - 1, LAYERS - 4],  # outputs of 1, L/2-1, L-4 = inputs of 2, L/2, L-3 (vLLM, SGLang)
}
ALL_VARIANTS = ("rope0-old", "rope0-new", "rope1-old", "rope1-new")


def has_key(key: str) -> bool:
    return key in TrainerConfig.__dataclass_fields__


TTT_STEPS: int | None = None  # --ttt-steps: training depth (default: the eval k: every drafted position trained)
TORCH_THREADS = 1  # --torch-threads: per training and per evaluation process


def overrides(variant: str, steps: int, out: Path, lr: float, seed: int = 0) -> list[str]:
    rope, layers, *rest = variant.split("-")
    if rest not in ([], ["fp8"]):
        raise SystemExit(f"variant {variant!r}: ROPE-LAYERS[-fp8], e.g. rope1-new or rope1-new-fp8")
    sets = [
        'target="tiny-trained"',
        'drafter_devices=["cpu"]',
        'drafter_mode="independent"',  # one drafter; cpu-demo's sweep list becomes this one learning rate
        f"drafter_lrs=[{lr}]",
        f"steps={steps}",
        "step_delay_s=0.0",
        "checkpoint_every=0",
        "log_every=50",
        f"target_layers={json.dumps(LAYER_SETS[layers])}",
        f'output_dir="{out}"',
        "resume=false",
        f"torch_threads={TORCH_THREADS}",
        f"seed={seed}",
    ]
    if TTT_STEPS is not None:
        sets.append(f"ttt_steps={TTT_STEPS}")
    if rest == ["fp8"]:
        sets.append("target_fp8=true")
    if has_key("ttt_rope_offset"):
        sets.append(f"ttt_rope_offset={'true' if rope == 'rope1' else 'false'}")
    return [arg for s in sets for arg in ("--set", s)]


def train(variant: str, steps: int, out: Path, lr: float, seed: int = 0) -> float:
    # The bench's own scratch directory, trained afresh: an output_dir holding a run's checkpoints is refused to
    # a run with resume = false (engine/trainer/run/resume.py), so an earlier bench's are removed first.
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", *overrides(variant, steps, out, lr, seed)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPECDEC_EVENTS", None)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tail = f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        raise SystemExit(f"training {variant} failed ({proc.returncode}):\n{tail}")
    return time.perf_counter() - t0


def measure(out: Path, k: int, conversations: int, max_new: int, *, as_served: bool = False) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "engine.trainer", "eval", "--checkpoint", str(out), "--json", "--k", str(k)]
    cmd += ["--as-served"] if as_served else []
    cmd += ["--conversations", str(conversations), "--max-new-tokens", str(max_new), "--threads", str(TORCH_THREADS)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"eval of {out} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    report: dict[str, Any] = json.loads(proc.stdout)
    (drafter,) = report["drafters"].values()
    return {**drafter, "ttt_rope_offset": report["ttt_rope_offset"], "target_layers": report["target_layers"]}


def tau_se(hist: list[int]) -> float:
    """The standard error of τ over rounds: the spread of one round's tokens (accepted + 1) over sqrt(rounds)."""
    n = sum(hist)
    if n < 2:
        return float("nan")
    mean = sum((a + 1) * c for a, c in enumerate(hist)) / n
    var = sum(c * (a + 1 - mean) ** 2 for a, c in enumerate(hist)) / (n - 1)
    return math.sqrt(var / n)


def fp8_pairs(variants: dict[str, Any]) -> list[str]:
    """Each ``-fp8`` run beside its exact-target twin of the same seed: τ of both as served by the exact target,
    the difference, and the spread of the exact twin across seeds (the noise)."""
    lines = []
    for name, run in variants.items():
        base, _, seed = name.partition("@")
        if not base.endswith("-fp8"):
            continue
        twin = variants.get(f"{base[: -len('-fp8')]}@{seed}" if seed else base[: -len("-fp8")])
        if twin is None:
            continue
        a, b = run["trained"], twin["trained"]
        sa, sb = tau_se(a["accepted_hist"]), tau_se(b["accepted_hist"])
        lines.append(
            f"{name}: tau {a['tau']:.3f} +- {sa:.3f} against {b['tau']:.3f} +- {sb:.3f} trained on the exact target: "
            f"difference {a['tau'] - b['tau']:+.3f} (combined standard error {math.hypot(sa, sb):.3f})"
        )
    exact = [r["trained"]["tau"] for n, r in variants.items() if not n.partition("@")[0].endswith("-fp8")]
    fp8 = [r["trained"]["tau"] for n, r in variants.items() if n.partition("@")[0].endswith("-fp8")]
    if lines and len(exact) > 1 and len(fp8) == len(exact):
        lines.append(
            f"over {len(exact)} seeds: exact-target drafters tau {sum(exact) / len(exact):.3f} "
            f"(range {min(exact):.3f}-{max(exact):.3f}), FP8-target drafters {sum(fp8) / len(fp8):.3f} "
            f"(range {min(fp8):.3f}-{max(fp8):.3f})"
        )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--variants", default=",".join(ALL_VARIANTS))
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--lr", type=float, default=2e-3, help="the drafter's learning rate (cpu-demo's first)")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--work", default="/tmp/bench_acceptance", help="output dirs of the training runs")
    ap.add_argument("--out", help="also write the results as JSON here")
    ap.add_argument("--ttt-steps", type=int, help="training depth (default: --k)")
    ap.add_argument("--torch-threads", type=int, default=1, help="torch threads of each training and evaluation")
    ap.add_argument("--seeds", default="0", help="train each variant once per seed (comma-separated)")
    args = ap.parse_args()
    try:
        seeds = [int(x) for x in args.seeds.split(",")]
    except ValueError:
        raise SystemExit(f"--seeds: comma-separated integers, not {args.seeds!r}") from None
    global TTT_STEPS, TORCH_THREADS
    TTT_STEPS = args.ttt_steps if args.ttt_steps is not None else args.k
    TORCH_THREADS = args.torch_threads

    t0 = time.perf_counter()
    target_dir = ensure_built()
    metrics = read_metrics(target_dir)
    print(
        f"target tiny-trained ({target_dir}, ready in {time.perf_counter() - t0:.0f} s): held-out next-token "
        f"accuracy {metrics['heldout_accuracy']:.3f}, entropy {metrics['heldout_entropy_bits']:.2f} bits "
        f"(uniform {metrics['uniform_entropy_bits']:.2f}), built in {metrics.get('build_s', '?')} s",
        flush=True,
    )
    results: dict[str, Any] = {
        "target": metrics,
        "steps": args.steps,
        "k": args.k,
        "ttt_steps": TTT_STEPS,
        "variants": {},
    }
    for variant in args.variants.split(","):
        if variant.startswith("rope1") and not has_key("ttt_rope_offset"):
            print(f"{variant}: skipped (this tree's config has no ttt_rope_offset key)", flush=True)
            continue
        for seed in seeds:
            name = f"{variant}@{seed}" if len(seeds) > 1 else variant
            work = Path(args.work) / name
            train(variant, 1, work / "untrained", lr=1e-30, seed=seed)
            before = measure(work / "untrained", args.k, args.conversations, args.max_new_tokens)
            train_s = train(variant, args.steps, work / "trained", lr=args.lr, seed=seed)
            after = measure(work / "trained", args.k, args.conversations, args.max_new_tokens)
            served = measure(work / "trained", args.k, args.conversations, args.max_new_tokens, as_served=True)
            results["variants"][name] = {
                "seed": seed,
                "untrained": before,
                "trained": after,
                "trained_as_served": served,
                "train_s": round(train_s, 1),
            }
            per = " ".join(f"{p:.2f}" for p in after["per_position_conditional"])
            print(
                f"{name}: layers {after['target_layers']} rope_offset {after['ttt_rope_offset']}: "
                f"tau untrained {before['tau']:.3f} -> {after['tau']:.3f} +- {tau_se(after['accepted_hist']):.3f} "
                f"after {args.steps} steps (ttt {TTT_STEPS}) ({train_s:.0f} s); accept_j|j-1 {per}; "
                f"rounds {after['rounds']}; as served (layers {served['target_layers']}, rope offset on): "
                f"tau {served['tau']:.3f}",
                flush=True,
            )
    for line in fp8_pairs(results["variants"]):
        print(line, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
