"""`a` then "Use this terminal" from a dashboard that itself runs inside tmux, with real tmux servers.

The dashboard runs in a pane (so $TMUX is set, as for a user) with a real client attached through a
pseudo-terminal. Same server as the run: the client is switched to the run's session. Another server:
the run's tmux is attached in this pane with $TMUX unset, and detaching gives the dashboard back.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import wait_until

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]
REPO = Path(__file__).resolve().parents[2]
DASH = "specdec-attach-dash"


def tmux(server: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["tmux", "-L", server, *args], capture_output=True, text=True, timeout=10)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "tui", *args], capture_output=True, text=True, env=env, timeout=60)


@contextlib.contextmanager
def attached_client(server: str, session: str) -> Iterator[subprocess.Popen[bytes]]:
    """A real tmux client on ``session`` (a terminal looking at it), through a pseudo-terminal."""
    primary, secondary = os.openpty()
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    env["TERM"] = "xterm-256color"
    proc = subprocess.Popen(
        ["tmux", "-L", server, "attach-session", "-t", session],
        stdin=secondary,
        stdout=secondary,
        stderr=secondary,
        env=env,
        start_new_session=True,
    )
    os.close(secondary)
    try:
        yield proc
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
        os.close(primary)


def client_sessions(server: str) -> list[str]:
    return tmux(server, "list-clients", "-F", "#{client_session}").stdout.split()


@pytest.fixture
def run_session(run_root: Path) -> Iterator[str]:
    """A live run on the test's tmux server (SPECDEC_TMUX_SOCKET); stopped at the end."""
    r = cli("launch", "local", "--run-root", str(run_root), "--wait", "started", "--json", "--", "sleep", "300")
    assert r.returncode == 0, r.stdout + r.stderr
    run_dir = run_root / "runs" / json.loads(r.stdout)["run_id"]
    session = json.loads((run_dir / "launch.json").read_text())["tmux_session"]
    try:
        yield str(session)
    finally:
        cli("stop", "local", "--run-root", str(run_root), "--grace", "2")


def start_dashboard(server: str, run_root: Path, config_dir: Path) -> None:
    """`specdec-tui connect local` in a pane of ``server``; $TMUX stays set, as it is for a user in tmux."""
    argv = [sys.executable, "-m", "tui", "connect", "local", "--no-launch", "--simulate-gpus", "1",
            "--run-root", str(run_root), "--python", sys.executable]  # fmt: skip
    env = {
        "SPECDEC_TUI_CONFIG_DIR": str(config_dir),
        "SPECDEC_TMUX_SOCKET": os.environ["SPECDEC_TMUX_SOCKET"],
        "PYTHONPATH": str(REPO),
        "TERM": "xterm-256color",
        "TEXTUAL_ANIMATIONS": "none",
    }
    command = f"env -u COLUMNS -u LINES {' '.join(f'{k}={shlex.quote(v)}' for k, v in env.items())} {shlex.join(argv)}"
    made = tmux(server, "new-session", "-d", "-s", DASH, "-x", "140", "-y", "40", "-c", str(REPO), command)
    assert made.returncode == 0, made.stderr
    tmux(server, "set-option", "-t", DASH, "remain-on-exit", "on")


def screen(server: str) -> str:
    return tmux(server, "capture-pane", "-p", "-t", DASH).stdout


def press_attach_here(server: str) -> str:
    """Press `a`, then `h` on the dialog; returns the dialog as it was shown."""
    wait_until(lambda: "running" in screen(server) and "SIMULATED" in screen(server), 30, "the dashboard with the run")
    tmux(server, "send-keys", "-t", DASH, "a")
    wait_until(lambda: "Use this terminal" in screen(server), 10, "the attach dialog")
    dialog = screen(server)
    tmux(server, "send-keys", "-t", DASH, "h")
    return dialog


def test_use_this_terminal_on_the_runs_own_server_switches_the_client(
    run_session: str, run_root: Path, tui_config_dir: Path
) -> None:
    server = os.environ["SPECDEC_TMUX_SOCKET"]
    start_dashboard(server, run_root, tui_config_dir)
    try:
        with attached_client(server, DASH):
            wait_until(lambda: client_sessions(server) == [DASH], 10, "the client on the dashboard's session")
            dialog = press_attach_here(server)
            assert "New tmux window" not in dialog, "a window on the same server would nest it"
            wait_until(lambda: client_sessions(server) == [run_session], 10, "the client switched to the run")
            assert "nested" not in screen(server) and "exited with status" not in screen(server), screen(server)
    finally:
        tmux(server, "kill-session", "-t", DASH)


def test_use_this_terminal_from_another_tmux_server_attaches_and_detach_returns(
    run_session: str, run_root: Path, tui_config_dir: Path
) -> None:
    run_server = os.environ["SPECDEC_TMUX_SOCKET"]
    outer = f"{run_server}-outer"
    start_dashboard(outer, run_root, tui_config_dir)
    try:
        with attached_client(outer, DASH):
            press_attach_here(outer)
            wait_until(lambda: client_sessions(run_server) == [run_session], 10, "a client on the run's session")
            assert "nested" not in screen(outer), screen(outer)
            tmux(run_server, "detach-client", "-s", run_session)
            wait_until(lambda: "SIMULATED" in screen(outer), 15, "the dashboard back after detaching")
            assert "exited with status" not in screen(outer), screen(outer)
    finally:
        tmux(outer, "kill-server")
