"""The real app at 80x24 in a real terminal: `specdec-tui connect local` inside tmux (private socket), read with
capture-pane. What a newcomer on a laptop's default terminal sees: the footer's words, the thread rows, the training
pane's rows, and notices that are news (not a finished run's history)."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.waiting import wait_until

from engine.supervisor import records

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]
REPO = Path(__file__).resolve().parents[2]
SESSION = "specdec-dash-80x24"
WIDTH, HEIGHT = 80, 24


def tmux(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["tmux", "-L", os.environ["SPECDEC_TMUX_SOCKET"], *args], capture_output=True, text=True, timeout=10
    )


class Terminal:
    """The dashboard in an 80x24 tmux pane."""

    def __init__(self, run_root: Path, config_dir: Path) -> None:
        self.run_root = run_root
        self.config_dir = config_dir

    def open(self, *args: str) -> None:
        argv = [
            sys.executable, "-m", "tui", "connect", "local", "--run-root", str(self.run_root),
            "--python", sys.executable, *args,
        ]  # fmt: skip
        env = {
            "SPECDEC_TUI_CONFIG_DIR": str(self.config_dir),
            "SPECDEC_TMUX_SOCKET": os.environ["SPECDEC_TMUX_SOCKET"],
            "PYTHONPATH": str(REPO),
            "TERM": "xterm-256color",
            "TEXTUAL_ANIMATIONS": "none",
        }
        assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        command = f"env -u TMUX -u COLUMNS -u LINES {assignments} {shlex.join(argv)}"
        tmux("kill-session", "-t", SESSION)
        made = tmux("new-session", "-d", "-s", SESSION, "-x", str(WIDTH), "-y", str(HEIGHT), "-c", str(REPO), command)
        assert made.returncode == 0, made.stderr
        tmux("set-option", "-t", SESSION, "remain-on-exit", "on")
        tmux("set-option", "-t", SESSION, "window-size", "manual")
        tmux("resize-window", "-t", SESSION, "-x", str(WIDTH), "-y", str(HEIGHT))

    def screen(self) -> str:
        return tmux("capture-pane", "-p", "-t", SESSION).stdout

    def wait(self, predicate: Callable[[str], bool], timeout_s: float, what: str) -> str:
        """The first screen that satisfies ``predicate``; fails after ``timeout_s``, showing the screen."""

        def look() -> str:
            shown = self.screen()
            return shown if predicate(shown) else ""

        return wait_until(look, timeout_s, what, observe=self.screen, interval_s=0.05)

    def keys(self, *keys: str) -> None:
        tmux("send-keys", "-t", SESSION, *keys)

    def close(self) -> None:
        tmux("kill-session", "-t", SESSION)
        for run_dir in sorted((self.run_root / "runs").glob("*")) if (self.run_root / "runs").is_dir() else []:
            launch = records.read_json(run_dir / records.LAUNCH_JSON) or {}
            for key in ("job_pgid", "pgid"):  # the job runs in its own session, the wrapper in another
                pgid = launch.get(key)
                if isinstance(pgid, int) and pgid > 1:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pgid, signal.SIGKILL)
            if launch.get("tmux_session"):
                tmux("kill-session", "-t", str(launch["tmux_session"]))


@pytest.fixture
def terminal(run_root: Path, tui_config_dir: Path) -> Iterator[Terminal]:
    term = Terminal(run_root, tui_config_dir)
    try:
        yield term
    finally:
        term.close()


# A job that leaves what a finished engine run leaves in its events: an export, then its end.
FINISHED_JOB = textwrap.dedent(
    """
    import json, os, time
    with open(os.environ["SPECDEC_EVENTS"], "a") as f:
        for ev in (
            {"kind": "export", "t": time.time(), "path": "/srv/drafter-x", "format": "eagle3", "step": 3},
            {"kind": "run_end", "t": time.time(), "ok": True, "reason": "steps done", "step": 3},
        ):
            f.write(json.dumps(ev) + "\\n")
    """
)


def launch_and_finish(run_root: Path, code: str) -> Path:
    """A run of ``code`` through the CLI, ended before the dashboard opens; its run directory."""
    argv = [sys.executable, "-m", "tui", "launch", "local", "--run-root", str(run_root), "--python", sys.executable]
    done = subprocess.run(
        [*argv, "--wait", "started", "--", sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = records.current_run_dir(run_root)
    assert run_dir is not None
    wait_until(lambda: (run_dir / records.EXIT_JSON).exists(), 30, "the run's exit record")
    return run_dir


def test_a_finished_runs_old_notices_do_not_come_back_over_the_launch_offer(terminal: Terminal) -> None:
    launch_and_finish(terminal.run_root, FINISHED_JOB)
    terminal.open()
    # The run's events were read (the timeline names its export) and the launch offer is up ...
    terminal.wait(lambda s: "exported" in s and "Launch (l)" in s and "Not now (n)" in s, 20, "history and offer")
    terminal.keys("n")
    # ... and once the offer is gone, no notice of that history was raised over it (a toast stays 8 s).
    shown = terminal.wait(lambda s: "Launch (l)" not in s, 10, "the offer to close")
    assert "engine finished" not in shown and "drafter exported" not in shown, shown


def test_a_live_run_at_80x24_names_every_key_every_threads_step_and_every_training_row(terminal: Terminal) -> None:
    terminal.open("--simulate-gpus", "4", "--launch")
    shown = terminal.wait(
        # the rows under the engine's process (a moment before the process scan has its threads, the heartbeats
        # alone list them, without the tree)
        lambda s: re.search(r"[├└] drafter1 train #\d+", s) is not None and " acc " in s and "rows hidden" in s,
        120,
        "thread rows with their step, and the training pane's acc rows",
    )
    lines = shown.splitlines()
    # The footer: every key with a word, in 80 columns.
    assert lines[-1].rstrip() == " l Run r Rerun s Stop k Stale a Tmux d Stack / Grep f Tail t Theme ? Help q Quit"
    # Each drafter's row keeps its state and step (it stopped at "training …" before).
    for thread in ("drafter0", "drafter1"):
        assert re.search(rf"[├└] {thread} train #\d+", shown), shown
    # The training pane (4 GPUs leave it 5 rows) keeps loss and acc, and says which rows it left out.
    rows = [line for line in lines if re.match(r"│ (step|tok/s|loss|acc) ", line)]
    assert [r.split()[1] for r in rows] == ["loss", "loss", "acc", "acc"], shown
    assert any("+4 rows hidden: step, tok/s" in line for line in lines), shown
    # Its title names the engine's output directory (what `specdec-train export` takes), its end kept.
    title = next(line for line in lines if "training" in line and "╭" in line)
    assert re.search(r"training · output …\S*/engine/runs/cpu-demo ", title), title
