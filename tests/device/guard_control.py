"""On a GPU: the target plus three drafter threads on one device, compile on, with and without the guard.

Runs ``python3 -m engine.trainer`` twice in subprocesses: once with the compile guard (must warm up and
train), once with it disabled (the control; expected to hang or fail). A run still alive at its timeout
gets SIGUSR1 first (faulthandler dumps every thread's stack into its output) and is then killed.

    python3 tests/device/guard_control.py [--timeout-s 120] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

COMMON = [
    "--set",
    'target="tiny"',
    "--set",
    "tiny_hidden=256",
    "--set",
    'target_devices=["cuda:0"]',
    "--set",
    'drafter_devices=["cuda:0","cuda:0","cuda:0"]',
    "--set",
    "drafter_lrs=[1e-3,1e-3,1e-3]",  # cpu-demo sweeps two rates: one per drafter device here
    "--set",
    'drafter_mode="independent"',
    "--set",
    "buckets=[512]",
    "--set",
    "batch_size=2",
    "--set",
    "ttt_steps=3",
    "--set",
    "steps=30",
    "--set",
    "compile=true",
    "--set",
    'attention="flex"',
    "--set",
    "draft_vocab_size=128",
    "--set",
    "step_delay_s=0.0",
    "--set",
    "torch_threads=0",
    "--set",
    "log_every=5",
    "--set",
    "resume=false",
]


def run(label: str, guard: bool, timeout_s: float, out: Path) -> dict[str, object]:
    run_dir = out / f"guard-{label}"
    shutil.rmtree(run_dir, ignore_errors=True)  # this script's own scratch run: resume = false refuses an old one
    args = [
        sys.executable,
        "-m",
        "engine.trainer",
        "--preset",
        "cpu-demo",
        "--output-dir",
        str(run_dir),
        *COMMON,
        "--set",
        f"compile_guard={'true' if guard else 'false'}",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "SPECDEC_EVENTS": str(run_dir / "events.jsonl")}
    log_path = out / f"guard-{label}.log"
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code: int | None = proc.wait(timeout=timeout_s)
            outcome = "exited"
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)  # all thread stacks into the log
            time.sleep(2.0)
            proc.kill()
            proc.wait()
            code = None
            outcome = f"no exit within {timeout_s:.0f} s (hang): SIGUSR1 stack dump, then killed"
    elapsed = time.monotonic() - t0
    events = []
    ev_path = run_dir / "events.jsonl"
    if ev_path.exists():
        events = [json.loads(line) for line in ev_path.read_text().splitlines() if line.strip()]
    steps = [e for e in events if e["kind"] == "step"]
    warm = [e["detail"] for e in events if e["kind"] == "stage" and e["stage"] in ("warmup", "training")]
    end = [e for e in events if e["kind"] == "run_end"]
    errors = [f"{e['thread']}: {e['exc_type']}: {e['message'][:200]}" for e in events if e["kind"] == "thread_error"]
    return {
        "label": label,
        "guard": guard,
        "outcome": outcome,
        "exit_code": code,
        "elapsed_s": round(elapsed, 1),
        "steps_logged": len(steps),
        "max_step": max((e["step"] for e in steps), default=0),
        "threads_stepping": sorted({e["thread"] for e in steps}),
        "warmup": warm,
        "thread_errors": errors,
        "run_end": end[-1] if end else None,
        "log": str(log_path),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--control-timeout-s", type=float, default=100.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/guard"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [run("on", True, a.timeout_s, out), run("off", False, a.control_timeout_s, out)]
    for r in results:
        print(json.dumps(r, indent=1))
        log = Path(str(r["log"])).read_text(errors="replace").splitlines()
        print(f"--- last lines of {r['label']} ---")
        tail = [ln for ln in log if "step=" not in ln][-25:]
        print("\n".join(tail))
    (out / "guard_results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
