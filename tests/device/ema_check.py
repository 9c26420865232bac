"""On a GPU: the drafter's weight average (``ema_decay``) as the engine keeps it there, step by step.

The average is updated on the drafter's CUDA stream after each optimizer step, from a float32 copy of the weights
made when the worker is built (on another thread and stream). What only a GPU run shows: that every update reads
the weights of its own step, and that the first one reads the copy of the initial weights, not memory still being
written. Runs ``python3 -m engine.trainer`` once (the tiny target, one drafter on cuda:0, compile on, a checkpoint
every step, ``ema_decay = 0.5``), then reads every checkpoint's trained weights ``w_s`` and average ``e_s``:

1. the recurrence, steps 2..N: ``e_s = lerp(e_{s-1}, w_s, 1 - d)``, ``d = min(0.5, s / (9 + s))``, recomputed on
   the CPU from the checkpoints, within float32 rounding;
2. the first update: ``e_1 = lerp(w_0, w_1, 0.9)``, so ``10 (w_1 - e_1)`` is the first optimizer step's move
   ``w_1 - w_0``; AdamW's first step moves each weight by ``lr * g / (|g| + eps)``: at most ``lr``, and ``lr`` for
   nearly all of them. An average begun from unwritten memory, or from the weights after the step, fails this;
3. ``specdec-train export`` serves the average (its config.json's ``specdec_export.weights``).

    python3 tests/device/ema_check.py [--out DIR] [--cpu]      # --cpu: the same on the CPU, compile off (dry run)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from engine.trainer import checkpoint as ckpt  # noqa: E402
from engine.trainer.draft.average import EMA_KEY  # noqa: E402

STEPS, DECAY, LR = 12, 0.5, 1e-3


def layout(cpu: bool) -> list[str]:
    dev = "cpu" if cpu else "cuda:0"
    sets = [
        'target="tiny"',
        "tiny_hidden=256",
        f'target_devices=["{dev}"]',
        f'drafter_devices=["{dev}"]',
        f"drafter_lrs=[{LR}]",
        "buckets=[128]" if cpu else "buckets=[512]",
        "batch_size=2",
        "ttt_steps=3",
        "draft_vocab_size=128",
        f"compile={'false' if cpu else 'true'}",
        'schedule="constant"',
        "warmup_steps=0",
        "weight_decay=0.0",
        f"steps={STEPS}",
        "checkpoint_every=1",
        f"keep_checkpoints={STEPS}",
        f"ema_decay={DECAY}",
        "step_delay_s=0.0",
        "log_every=1",
        "resume=false",
    ]
    return [x for s in sets for x in ("--set", s)]


def fail(what: str) -> int:
    print(f"FAIL weight average: {what}")
    return 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ema-check"))
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--timeout-s", type=float, default=240.0)
    a = ap.parse_args()
    out = Path(a.out)
    run_dir, export_dir = out / "ema-run", out / "ema-export"
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own scratch run
    shutil.rmtree(export_dir, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--output-dir", str(run_dir), *layout(a.cpu)]
    log = out / "ema-run.log"
    with log.open("w") as f:
        try:
            code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=a.timeout_s)
        except subprocess.TimeoutExpired:
            return fail(f"the run did not end within {a.timeout_s:.0f} s (log: {log})")
    if code.returncode != 0:
        return fail(f"the run exited {code.returncode} (log: {log})")
    found = ckpt.owned_checkpoints(run_dir)
    steps = [int(ckpt.read_meta(p)["step"]) for p in found]
    if steps != list(range(1, STEPS + 1)):
        return fail(f"checkpoints at steps {steps}, expected 1..{STEPS}")
    states = [ckpt.load_drafter_state(p, "drafter0") for p in found]
    if any(not isinstance(s.get(EMA_KEY), dict) for s in states):
        return fail("a checkpoint without the average")
    updates = [int(s[EMA_KEY]["updates"]) for s in states]
    if updates != steps:
        return fail(f"the average's update counts {updates}, expected the steps {steps}")
    names = sorted(states[0][EMA_KEY]["weights"])
    w = [{n: s["model"][n].float() for n in names} for s in states]
    e = [{n: s[EMA_KEY]["weights"][n].float() for n in names} for s in states]
    worst, worst_name = 0.0, ""
    for i in range(1, STEPS):  # checkpoint i holds step i + 1; its update counted i before it
        weight = 1.0 - min(DECAY, (1.0 + i) / (10.0 + i))
        for n in names:
            want = torch.lerp(e[i - 1][n], w[i][n], weight)
            err = float((e[i][n] - want).abs().max()) / (1.0 + float(want.abs().max()))
            if err > worst:
                worst, worst_name = err, n
    if not worst <= 1e-6:
        return fail(f"the recurrence is off by {worst:.2e} (relative) at {worst_name}")
    moves = torch.cat([(10.0 * (w[0][n] - e[0][n])).abs().flatten() for n in names])
    if not bool(torch.isfinite(moves).all()):
        return fail("the first update read non-finite values")
    median, top = float(moves.median()), float(moves.max())
    near = float((moves > 0.5 * LR).float().mean())
    if not (0.5 * LR <= median <= 1.01 * LR and top <= 1.01 * LR + 1e-6 and near >= 0.5):
        return fail(f"the first step's move implied by the average: median {median:.3e}, max {top:.3e}, "
                    f"{near:.0%} above lr / 2 (AdamW's first step: each weight by about lr = {LR:g}, "
                    "at most lr)")  # fmt: skip
    code = subprocess.run([sys.executable, "-m", "engine.trainer", "export", str(run_dir), str(export_dir)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    if code.returncode != 0:
        return fail(f"export exited {code.returncode}: {code.stderr.strip()[-300:]}")
    served = json.loads((export_dir / "config.json").read_text()).get("specdec_export", {}).get("weights", "")
    if not str(served).startswith("moving average"):
        return fail(f"the export serves {served!r}, not the average")
    where = "the CPU (dry run)" if a.cpu else "cuda:0"
    print(f"PASS weight average on {where}: {STEPS} steps, the recurrence within {worst:.1e} (relative) at every step, "
          f"the first update from the initial weights (implied first move: median {median:.2e}, max {top:.2e}, "
          f"lr {LR:g}), export serves it ({served})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
