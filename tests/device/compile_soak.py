"""Compile soak: the three-drafter layout that died of a recompile after warm-up, several runs, with and
without a recompile forced mid-run. One PASS/FAIL line per check.

The layout (issue: target "tiny", tiny_hidden 256, three independent drafters on cuda:0, bucket 512, batch 2,
3 TTT steps, compile on; the seed died with flex attention, which is the engine's CUDA default again: the merged
attention's CUDA gradients were measured wrong and it is refused there).
Each run is a fresh ``python3 tests/device/compile_soak.py --one``
process running the engine in-process, so the run can count its TTT step's retries and graphs at exit. With
``--force-at K`` the process changes torch's intra-op thread count when drafter1 reaches its K-th TTT step
call: a global state every compiled graph guards on, so every thread's next call must recompile while the
others run compiled code (the race the compile guard exists for).

    python3 tests/device/compile_soak.py [--runs 3] [--steps 300] [--forced-runs 2] [--parallel 1] [--cpu]

``--parallel N`` runs N of those processes at once (the race is between one process's threads, so runs side by
side on one GPU are still independent runs; it lets the 10 x 1000-step soak fit a 10-minute device call).

``--cpu`` (no GPU): drafters on the CPU with SDPA attention, the TTT step compiled with dynamo's aot_eager
backend (FX tracing like inductor, no C++ build), so the soak itself can be dry-run anywhere.
A run passes when it ends ok (exit 0, ``run_end`` ok) with every compile event accounted for: no recompile
without a forced one, and a forced one handled (events, no death).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 400.0

GPU_LAYOUT = [
    'target="tiny"',
    "tiny_hidden=256",
    'target_devices=["cuda:0"]',
    'drafter_devices=["cuda:0","cuda:0","cuda:0"]',
    "drafter_lrs=[1e-3,1e-3,1e-3]",
    'drafter_mode="independent"',
    "buckets=[512]",
    "batch_size=2",
    "ttt_steps=3",
    "compile=true",
]
CPU_LAYOUT = [
    'target="tiny"',
    'target_devices=["cpu"]',
    'drafter_devices=["cpu","cpu","cpu"]',
    "drafter_lrs=[1e-3,1e-3,1e-3]",
    'drafter_mode="independent"',
    "buckets=[128]",
    "batch_size=2",
    "ttt_steps=3",
    "compile=true",
    'attention="sdpa"',
]
COMMON = ["step_delay_s=0.0", "log_every=50", "resume=false", "checkpoint_every=0"]


def one_run(args: argparse.Namespace, engine_argv: list[str]) -> int:
    """The engine in this process, its shared TTT step wrapped to force a recompile and report at exit."""
    import torch

    import engine.trainer.run.assembly as assembly
    import engine.trainer.run.loop as engine_mod
    from engine.trainer.draft.attention import TTTAttention
    from engine.trainer.draft.model import ttt_step
    from engine.trainer.threads.compile import GuardedFunction

    made: list[GuardedFunction] = []
    forced: list[float] = []
    calls = {"n": 0}
    original = assembly.shared_step

    class Forcing(GuardedFunction):
        def __call__(self, *a: Any, **kw: Any) -> Any:
            if args.force_at and threading.current_thread().name == "drafter1" and not forced:
                calls["n"] += 1
                if calls["n"] == args.force_at:
                    torch.set_num_threads(max(1, torch.get_num_threads()) + 1)  # every graph guards on it
                    forced.append(time.time())
            return super().__call__(*a, **kw)

    def shared_step(cfg: Any, ddevs: Any, impl: str, on_compile: Any) -> Any:
        if args.cpu:
            attention = TTTAttention(impl, compiled=False)
            step_fn: GuardedFunction = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="aot_eager")
            step_fn.listeners.append(on_compile)
        else:
            attention, step_fn = original(cfg, ddevs, impl, on_compile)
        step_fn.__class__ = Forcing
        made.append(step_fn)
        return attention, step_fn

    assembly.shared_step = shared_step
    engine_mod.shared_step = shared_step

    def report() -> None:
        fn = made[0] if made else None
        summary = {
            "retries": fn.retries if fn else None,
            "graphs": fn.graph_count() if fn else None,
            "compiled": fn.compiled if fn else None,
            "forced": len(forced),
            "events": [e.what + ":" + str(e.thread) for e in fn.events] if fn else [],
        }
        print("SOAK " + json.dumps(summary), flush=True)

    atexit.register(report)
    from engine.trainer.__main__ import main

    return main(engine_argv)


def launch(args: argparse.Namespace, out: Path, label: str, force_at: int) -> dict[str, Any]:
    layout = CPU_LAYOUT if args.cpu else [*GPU_LAYOUT, f'attention="{args.attention}"']
    run_dir = out / label
    # A soak run starts a new run: an earlier soak's run of this label (its log is rewritten below too) would hold
    # checkpoints that the engine refuses to prune against (resume = false), and the run would die at its config.
    shutil.rmtree(run_dir, ignore_errors=True)
    engine_argv = ["--preset", "cpu-demo", "--output-dir", str(run_dir)]
    for item in [*layout, *COMMON, f"steps={args.steps}"]:
        engine_argv += ["--set", item]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--force-at", str(force_at)]
    cmd += ["--cpu"] if args.cpu else []
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    env["SPECDEC_EVENTS"] = str(run_dir / "events.jsonl")
    t0 = time.monotonic()
    log = out / f"{label}.log"
    with log.open("w") as fh:
        try:
            rc: int | None = subprocess.run(
                [*cmd, "--", *engine_argv], cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT,
                timeout=args.run_timeout, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = None
    text = log.read_text(errors="replace")
    soak: dict[str, Any] = next((json.loads(line[5:]) for line in text.splitlines() if line.startswith("SOAK ")), {})
    events = _events(run_dir / "events.jsonl")
    steps = [e for e in events if e.get("kind") == "step"]
    ends = [e for e in events if e.get("kind") == "run_end"]
    compiles = [e for e in events if e.get("kind") == "compile"]
    return {
        "label": label,
        "rc": rc,
        "s": time.monotonic() - t0,
        "ok": bool(ends and ends[-1].get("ok")),
        "last_step": max([int(e.get("step") or 0) for e in steps + ends[-1:]], default=0),
        "recompiles": sum(1 for e in compiles if e.get("what") == "recompile"),
        # the guard each recompile names (the forced one changes a global every graph guards on: the thread count)
        "guards": [e.get("guard") for e in compiles if e.get("what") == "recompile"],
        "fallbacks": sum(1 for e in compiles if e.get("what") == "fallback"),
        "fx_death": "symbolically trace a dynamo-optimized function" in text,
        "soak": soak,
        "log": str(log),
    }


def _events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs without a forced recompile")
    ap.add_argument("--forced-runs", type=int, default=2, help="runs with a recompile forced mid-run")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--parallel", type=int, default=1, help="runs at once (separate processes)")
    ap.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT_S, help="seconds before one run counts as hung")
    ap.add_argument("--force-at", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help="dry run without a GPU (aot_eager on the CPU)")
    ap.add_argument("--attention", choices=["flex"], default="flex", help="the GPU layout's attention")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=None, help="keep the runs' logs here")
    ap.add_argument("rest", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.one:
        rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
        return one_run(args, rest)
    out = args.out or Path(tempfile.mkdtemp(prefix="compile-soak-"))
    out.mkdir(parents=True, exist_ok=True)
    force_at = max(30, args.steps * 3 // 2)  # drafter1's TTT step calls (3 a step): about half-way through
    plan = [(f"plain{i}", 0) for i in range(args.runs)] + [(f"forced{i}", force_at) for i in range(args.forced_runs)]
    if args.parallel < 1:
        ap.error("--parallel: at least 1")
    results = []
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        runs = pool.map(lambda item: launch(args, out, *item), plan)
        for res in runs:
            results.append(res)
            soak = res["soak"]
            print(
                f"  {res['label']}: rc {res['rc']} ok {res['ok']} steps {res['last_step']} in {res['s']:.0f} s; "
                f"recompiles {res['recompiles']}, fallbacks {res['fallbacks']}, retries {soak.get('retries')}, "
                f"graphs {soak.get('graphs')}, forced {soak.get('forced')}; log {res['log']}",
                flush=True,
            )
    plain = [r for r in results if r["label"].startswith("plain")]
    forced = [r for r in results if r["label"].startswith("forced")]

    def alive(r: dict[str, Any]) -> bool:
        return r["rc"] == 0 and r["ok"] and not r["fx_death"] and r["last_step"] >= args.steps

    lines = [
        (
            all(alive(r) and r["recompiles"] == 0 and r["fallbacks"] == 0 for r in plain),
            f"compile soak: {len(plain)} runs x {args.steps} steps, "
            f"{sum(1 for r in plain if not alive(r))} deaths, {sum(r['recompiles'] for r in plain)} recompiles",
        ),
        (
            all(alive(r) and r["soak"].get("forced") == 1 and r["recompiles"] >= 1 for r in forced),
            f"compile soak, recompile forced mid-run: {len(forced)} runs x {args.steps} steps, "
            f"{sum(1 for r in forced if not alive(r))} deaths, "
            f"{sum(r['recompiles'] for r in forced)} recompiles (events), all serialised",
        ),
        (
            bool(forced) and all(r["guards"] and all(r["guards"]) for r in forced),
            f"compile soak, the forced recompiles name their guard: "
            f"{sum(sum(1 for g in r['guards'] if g) for r in forced)} of {sum(r['recompiles'] for r in forced)} "
            f"events, e.g. {next((g for r in forced for g in r['guards'] if g), None)!r}",
        ),
    ]
    for ok, text in lines:
        print(f"{'PASS' if ok else 'FAIL'} {text}", flush=True)
    return 0 if all(ok for ok, _ in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
