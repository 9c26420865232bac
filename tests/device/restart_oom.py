"""On a GPU host: the restart policy against a real CUDA OOM, with the launch wrapper as it runs under tmux.

Run from the repo root:  python3 tests/device/restart_oom.py [--gib-too-many 100000]
Prints a report; exits non-zero when a check fails. The job (torch on cuda:0):
1. attempt 1 asks for far more GPU memory than the card has: torch raises its real OutOfMemoryError, the
   job dies of it (exit 1) after printing the traceback;
2. the wrapper must find the OOM in the job's last lines, restart it as cause "oom" with
   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True added, and say so in output.log;
3. attempt 2 prints that variable as torch sees it, allocates 1 GiB, makes one step and exits 0.
Timings (exit -> restarted -> first output -> first step) come from restarts.json and events the job writes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

JOB = r"""
import json, os, sys, time
import torch
attempt = int(os.environ["SPECDEC_ATTEMPT"])
conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
print(f"attempt {attempt} PYTORCH_CUDA_ALLOC_CONF={conf} cuda={torch.cuda.is_available()}", flush=True)
torch.zeros(1, device="cuda")  # CUDA context first: the OOM below is about memory, not start-up
if attempt == 1:
    x = torch.empty(int(sys.argv[1]) * 2**30, dtype=torch.uint8, device="cuda")
y = torch.ones(2**30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
with open(os.environ["SPECDEC_EVENTS"], "a") as ev:
    ev.write(json.dumps({"t": time.time(), "kind": "step", "step": 1}) + "\n")
print(f"step=1 allocated {y.numel() / 2**30:.0f} GiB", flush=True)
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib-too-many", type=int, default=100_000)
    ns = parser.parse_args()
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.py"
        job.write_text(JOB)
        run_dir = Path(tmp) / "runs" / "oom1"
        spec = {
            "run_id": "oom1",
            "spec": {
                "command": [sys.executable, str(job), str(ns.gib_too_many)],
                "cwd": tmp,
                "restart": {"on": ["crash", "oom"], "max": 2, "backoff_s": 1.0, "stall_s": 600.0, "grace_s": 10.0},
            },
        }
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        t0 = time.monotonic()
        wrapper = [sys.executable, "-m", "engine.supervisor.wrapper", "--run-dir", str(run_dir)]
        done = subprocess.run(
            [*wrapper, "--spec-json", str(spec_path)],
            cwd=REPO,
            timeout=300,
            check=False,
        )
        wall_s = time.monotonic() - t0
        log = (run_dir / "output.log").read_text(errors="replace")
        doc = json.loads((run_dir / "restarts.json").read_text())
        exit_rec = json.loads((run_dir / "exit.json").read_text())
        events_path = run_dir / "events.jsonl"
        lines = events_path.read_text().splitlines() if events_path.exists() else []
        events = [json.loads(line) for line in lines if line.strip()]
        print(log)
        print(json.dumps(doc["restarts"], indent=1))
        restarts = doc["restarts"]
        if done.returncode != 0 or exit_rec.get("exit_code") != 0:
            failures.append(f"the run did not end well: wrapper rc {done.returncode}, exit {exit_rec}")
        if [r.get("cause") for r in restarts] != ["oom"]:
            failures.append(f"restart causes {[r.get('cause') for r in restarts]}, expected ['oom']")
        if "torch.OutOfMemoryError" not in (restarts[0].get("detail") if restarts else ""):
            failures.append("the OOM line was not recorded in the restart's detail")
        if "attempt 2 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" not in log:
            failures.append("attempt 2 did not see PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
        if "added to the job's environment" not in log:
            failures.append("output.log does not say the allocator setting was added")
        if restarts and events:
            r = restarts[0]
            step_t = events[-1]["t"]
            print(
                f"timings: exit -> restarted {r['restarted_at'] - r['at']:.3f} s (backoff {r['backoff_s']:g} s), "
                f"exit -> first output {r.get('first_output_at', float('nan')) - r['at']:.3f} s, "
                f"exit -> first step {step_t - r['at']:.3f} s; whole run {wall_s:.1f} s"
            )
    for f in failures:
        print(f"FAIL: {f}")
    print("OK" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
