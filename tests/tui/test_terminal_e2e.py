"""The real app in a real terminal: `specdec-tui connect local` inside tmux (private socket),
driven with send-keys and read with capture-pane, running the engine's CPU demo.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.procfs import pid_alive
from support.waiting import wait_until

from engine.supervisor import records

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]
REPO = Path(__file__).resolve().parents[2]
SESSION = "specdec-dash-e2e"


def tmux(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["tmux", "-L", os.environ["SPECDEC_TMUX_SOCKET"], *args], capture_output=True, text=True, timeout=10
    )


def screen(history: bool = False) -> str:
    """The pane's visible screen; with ``history``, its scrollback too (tmux 3.3a scrolls a dead pane's last
    screen into history when it writes "Pane is dead", so a message printed just before exit is only there)."""
    return tmux("capture-pane", "-p", *(("-S", "-") if history else ()), "-t", SESSION).stdout


def wait_screen(predicate: Callable[[str], bool], timeout_s: float, what: str, *, history: bool = False) -> float:
    """Seconds until the captured screen satisfies ``predicate``; fails after ``timeout_s``, showing the screen."""
    start = time.monotonic()

    def look() -> str:
        return screen(history)

    wait_until(lambda: predicate(look()), timeout_s, what, observe=look, interval_s=0.05)
    return time.monotonic() - start


@pytest.fixture
def dashboard_in_tmux(run_root: Path, tui_config_dir: Path) -> Iterator[Path]:
    argv = [
        sys.executable, "-m", "tui", "connect", "local", "--simulate-gpus", "2",
        "--run-root", str(run_root), "--python", sys.executable,
    ]  # fmt: skip
    env = {
        "SPECDEC_TUI_CONFIG_DIR": str(tui_config_dir),
        "SPECDEC_TMUX_SOCKET": os.environ["SPECDEC_TMUX_SOCKET"],
        "PYTHONPATH": str(REPO),
        "TERM": "xterm-256color",
        "TEXTUAL_ANIMATIONS": "none",
    }
    # COLUMNS/LINES from the test process would override the pane size that Textual reads.
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    command = f"env -u TMUX -u COLUMNS -u LINES {assignments} {shlex.join(argv)}"
    tmux("kill-session", "-t", SESSION)
    made = tmux("new-session", "-d", "-s", SESSION, "-x", "150", "-y", "46", "-c", str(REPO), command)
    assert made.returncode == 0, made.stderr
    tmux("set-option", "-t", SESSION, "remain-on-exit", "on")
    tmux("set-option", "-t", SESSION, "window-size", "manual")
    tmux("resize-window", "-t", SESSION, "-x", "150", "-y", "46")
    try:
        yield run_root
    finally:
        tmux("kill-session", "-t", SESSION)
        run_dir = records.current_run_dir(run_root)
        launch = records.read_json(run_dir / records.LAUNCH_JSON) if run_dir else None
        for key in ("job_pgid", "pgid"):  # the job runs in its own session, the wrapper in another
            pgid = (launch or {}).get(key)
            if isinstance(pgid, int) and pgid > 1:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
        if launch and launch.get("tmux_session"):
            tmux("kill-session", "-t", str(launch["tmux_session"]))


def test_connect_local_shows_every_pane_and_quit_leaves_the_run(dashboard_in_tmux: Path) -> None:
    run_root = dashboard_in_tmux
    first = wait_screen(lambda s: "SIMULATED" in s and "util" in s and "processes" in s, 15, "GPU pane")
    tmux("send-keys", "-t", SESSION, "l")
    log_s = wait_screen(lambda s: "following ·" in s and "lines" in s and "log created" in s, 15, "log lines")
    chart_s = wait_screen(lambda s: "tok/s  drafter" in s and "step   drafter" in s, 60, "chart points")
    tree_s = wait_screen(lambda s: "drafter0    training step" in s and "hb " in s, 15, "thread health")
    print(f"first frame {first:.2f} s; after l: log {log_s:.2f} s, chart {chart_s:.2f} s, threads +{tree_s:.2f} s")
    run_dir = records.current_run_dir(run_root)
    assert run_dir is not None
    launch = records.read_json(run_dir / records.LAUNCH_JSON) or {}
    pid = launch.get("job_pid") or launch.get("pid")
    assert isinstance(pid, int) and pid_alive(pid)
    tmux("send-keys", "-t", SESSION, "q")
    wait_screen(lambda s: "keeps running" in s, 15, "the exit message", history=True)
    quit_at = time.monotonic()

    def exit_status() -> str:  # tmux marks the pane dead, then records the status
        # tmux 3.3a can miss a child's SIGCHLD (the pane never turns dead); run-shell makes the server reap.
        tmux("run-shell", "true")
        return tmux("display-message", "-p", "-t", SESSION, "#{?pane_dead,#{pane_dead_status},}").stdout.strip()

    status = wait_until(exit_status, 30, "the dashboard to exit after q", interval_s=0.05)
    assert status == "0", screen()
    print(f"exited {time.monotonic() - quit_at:.2f} s after the exit message")
    assert pid_alive(pid)
    assert tmux("has-session", "-t", str(launch["tmux_session"])).returncode == 0
