"""The dashboard on a GPU host, read off the screen: the engine under the supervisor, `specdec-tui connect
local` in tmux (its own socket, 200x50), checks on the captured screen and on `status --json`.

    python3 tests/device/dashboard_check.py [--out DIR] [--simulate-gpus N]

Checks, one PASS/FAIL line each (SKIP where the host cannot say, e.g. no nvidia-smi with --simulate-gpus):
  * the engine's four threads (target0, drafter0..2) have one row each in the process pane, with the
    engine's pid line and the stale-holder list on the same screen;
  * GPU 0's utilisation and memory are above 0 while the drafters train;
  * the dashboard's own agent is not a stale holder (screen and status);
  * the GPU rows (name, memory total and used) equal nvidia-smi's.
The final screen is written to DIR/dashboard_screen.txt. --simulate-gpus: a dry run without a GPU (the
CPU layout, simulated GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tui.dashboard.widgets.gpu_bars import short_gpu_name

REPO = Path(__file__).resolve().parents[2]
THREADS = ("target0", "drafter0", "drafter1", "drafter2")
COLS, ROWS = 200, 50
FIRST_STEP_WITHIN_S = 300
SCREEN_WITHIN_S = 90.0
GPU_LAYOUT = [
    'target="tiny"',
    "tiny_hidden=256",
    'target_devices=["cuda:0"]',
    'drafter_devices=["cuda:0","cuda:0","cuda:0"]',
    "drafter_lrs=[1e-3,1e-3,1e-3]",
    "buckets=[512]",
    "compile=true",
    'attention="flex"',
]
CPU_LAYOUT = ['target="tiny"', 'drafter_devices=["cpu","cpu","cpu"]', "drafter_lrs=[1e-3,1e-3,1e-3]", "buckets=[128]"]
COMMON = ["steps=100000", "step_delay_s=0.0", "log_every=10", "resume=false", "checkpoint_every=0"]
MEM_USED_TOLERANCE_MIB = 512.0  # nvidia-smi and the agent sample a training GPU moments apart


class Tmux:
    def __init__(self, socket: str) -> None:
        self.socket = socket

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=10)

    def screen(self, session: str) -> str:
        return self("capture-pane", "-p", "-t", session).stdout


def cli(run_root: Path, *args: str, simulate: int | None, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    sim = ["--simulate-gpus", str(simulate)] if simulate else []
    argv = [sys.executable, "-m", "tui", args[0], "local", "--run-root", str(run_root), "--python", sys.executable]
    return subprocess.run(
        [*argv, *sim, *args[1:]], cwd=REPO, capture_output=True, text=True, timeout=timeout_s, check=False
    )


def wait_for(predicate: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--simulate-gpus", type=int, default=None, help="dry run: CPU engine, simulated GPUs")
    args = ap.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="device-dashboard-"))
    out.mkdir(parents=True, exist_ok=True)
    if shutil.which("tmux") is None:
        print("FAIL dashboard: tmux is not installed")
        return 1
    sim = args.simulate_gpus
    root = Path(tempfile.mkdtemp(prefix="specdec-device-"))
    run_root = root / "runs"
    tmux = Tmux(f"specdec-device-{os.getpid()}")
    session = "dashboard"
    results: list[tuple[str, str]] = []
    try:
        engine = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--output-dir", str(root / "out")]
        for item in [*(CPU_LAYOUT if sim else GPU_LAYOUT), *COMMON]:
            engine += ["--set", item]
        launched = cli(
            run_root, "launch", "--wait", "first-step", "--timeout", str(FIRST_STEP_WITHIN_S), "--json",
            "--cwd", str(REPO), "--", *engine, simulate=sim, timeout_s=FIRST_STEP_WITHIN_S + 60,
        )  # fmt: skip
        if launched.returncode != 0:
            print(f"FAIL launch: exit {launched.returncode}: {(launched.stdout + launched.stderr)[-600:]}")
            return 1
        env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO)), "TERM": "xterm-256color"}
        env["TEXTUAL_ANIMATIONS"] = "none"
        env["SPECDEC_TUI_CONFIG_DIR"] = str(root / "tui-config")
        dash = [sys.executable, "-m", "tui", "connect", "local", "--run-root", str(run_root), "--no-launch"]
        dash += ["--python", sys.executable, *(["--simulate-gpus", str(sim)] if sim else [])]
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        command = f"env -u TMUX -u COLUMNS -u LINES {assignments} {shlex.join(dash)}"
        made = tmux("new-session", "-d", "-s", session, "-x", str(COLS), "-y", str(ROWS), "-c", str(REPO), command)
        if made.returncode != 0:
            print(f"FAIL dashboard: tmux new-session: {made.stderr.strip()}")
            return 1
        tmux("set-option", "-t", session, "window-size", "manual")
        tmux("resize-window", "-t", session, "-x", str(COLS), "-y", str(ROWS))

        def rows_of(text: str, name: str) -> int:
            return len(re.findall(rf"[├└] {name}\b", text))

        def full_screen() -> str | None:
            text = tmux.screen(session)
            ready = all(rows_of(text, n) for n in THREADS) and "stale GPU holders" in text
            return text if ready and re.search(r"step \d+", text) else None

        screen = wait_for(full_screen, SCREEN_WITHIN_S) or tmux.screen(session)
        (out / "dashboard_screen.txt").write_text(screen)
        counts = {n: rows_of(screen, n) for n in THREADS}
        # the processes pane sits right of the training pane: its rows start after a border, not at the line's start
        pid_line = re.search(r"(?:^|│)\s*\d+ \S*python\S* .*engine\.trainer", screen, re.M) is not None
        ok = all(c == 1 for c in counts.values()) and pid_line and "stale GPU holders" in screen
        results.append(("PASS" if ok else "FAIL", f"engine threads once each on {COLS}x{ROWS}: {counts}, "
                        f"pid line {'shown' if pid_line else 'missing'}, stale list "
                        f"{'shown' if 'stale GPU holders' in screen else 'missing'}"))  # fmt: skip

        samples: list[dict[str, Any]] = []
        for _ in range(5):
            st = cli(run_root, "status", "--json", simulate=sim)
            if st.returncode == 0:
                samples.append(json.loads(st.stdout))
            time.sleep(1.0)
        gpu0 = [g for s in samples for g in s.get("gpus", []) if g.get("index") == 0]
        util = max((g.get("util_pct") or 0.0 for g in gpu0), default=0.0)
        mem = max((g.get("mem_used_mib") or 0.0 for g in gpu0), default=0.0)
        if sim:
            results.append(("SKIP", "GPU 0 while training: simulated GPUs carry no load"))
        else:
            results.append(("PASS" if util > 0 and mem > 0 else "FAIL",
                            f"GPU 0 while training: util up to {util:.0f}%, memory up to {mem:.0f} MiB"))  # fmt: skip

        agent_pids = {s["host"].get("agent_pid") for s in samples}
        self_stale = [
            h for s in samples for h in s["processes"]["holders"]
            if (h["pid"] in agent_pids or "engine.agent" in (h.get("cmd") or "")) and h.get("context") is not False
        ]  # fmt: skip
        screen_stale = [line for line in screen.splitlines() if "STALE" in line and "engine.agent" in line]
        results.append(("PASS" if not self_stale and not screen_stale else "FAIL",
                        f"no self-stale: {len(self_stale)} agent holders in status, "
                        f"{len(screen_stale)} STALE agent lines on screen"))  # fmt: skip

        gpu_rows = gpu_rows_vs_nvidia_smi(samples[-1] if samples else {}, screen, sim)
        if gpu_rows[0] == "FAIL" and "not on the screen" in gpu_rows[1]:
            # Seen once on the H200: the GPUs pane one blank row. Say whether it is a moment or it stays.
            later = []
            for second in range(1, 11):
                time.sleep(1.0)
                again = tmux.screen(session)
                (out / f"dashboard_screen_gpu_{second}s.txt").write_text(again)
                if not rows_not_shown(samples[-1], again):  # the screen alone: nvidia-smi was compared already
                    later.append(second)
                    break
            when = f"shown {later[0]} s later" if later else "still missing 10 s later"
            gpu_rows = ("FAIL", f"{gpu_rows[1]} (the first full screen; {when})")
        results.append(gpu_rows)
    finally:
        tmux("kill-session", "-t", session)
        tmux("kill-server")
        stopped = cli(run_root, "stop", simulate=sim, timeout_s=120)
        if stopped.returncode != 0:
            print(f"(stop: exit {stopped.returncode}: {(stopped.stdout + stopped.stderr)[-300:]})")
    for verdict, text in results:
        print(f"{verdict} {text}", flush=True)
    print(f"(screen: {out / 'dashboard_screen.txt'})")
    return 0 if all(v != "FAIL" for v, _ in results) else 1


def rows_not_shown(status: dict[str, Any], screen: str) -> list[str]:
    """The status's GPUs whose row is not on the screen (the row drops the vendor: "NVIDIA H200" reads "H200")."""
    missing = []
    for gpu in status.get("gpus", []):
        index, name = gpu.get("index"), str(gpu.get("name"))
        shown = short_gpu_name(name)
        if not re.search(rf"\b{index} {re.escape(shown)}\s", screen):
            missing.append(f"GPU {index}: {shown!r} ({name!r}) not on the screen")
    return missing


def gpu_rows_vs_nvidia_smi(status: dict[str, Any], screen: str, sim: int | None) -> tuple[str, str]:
    smi = shutil.which("nvidia-smi")
    if sim or smi is None:
        return ("SKIP", "GPU rows vs nvidia-smi: simulated GPUs or no nvidia-smi on this host")
    query = "index,name,memory.total,memory.used"
    res = subprocess.run(
        [smi, f"--query-gpu={query}", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
    )
    theirs = [[c.strip() for c in line.split(",")] for line in res.stdout.strip().splitlines()]
    ours = status.get("gpus", [])
    problems = []
    if len(theirs) != len(ours):
        problems.append(f"{len(ours)} GPUs, nvidia-smi {len(theirs)}")
    for row, gpu in zip(theirs, ours, strict=False):
        index, name, total, used = int(row[0]), row[1], float(row[2]), float(row[3])
        if gpu.get("index") != index or gpu.get("name") != name:
            problems.append(f"GPU {index}: {gpu.get('name')!r} vs {name!r}")
        if abs(float(gpu.get("mem_total_mib") or 0) - total) > 1.0:
            problems.append(f"GPU {index}: total {gpu.get('mem_total_mib')} vs {total} MiB")
        if abs(float(gpu.get("mem_used_mib") or 0) - used) > MEM_USED_TOLERANCE_MIB:
            problems.append(f"GPU {index}: used {gpu.get('mem_used_mib')} vs {used} MiB")
    problems += rows_not_shown(status, screen)
    detail = "; ".join(problems) if problems else f"{len(ours)} GPU(s) equal (name, total, used within 512 MiB)"
    return ("FAIL" if problems else "PASS", f"GPU rows vs nvidia-smi: {detail}")


if __name__ == "__main__":
    raise SystemExit(main())
