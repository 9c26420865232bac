"""Nothing a job chooses reaches the viewer's terminal as a control sequence or as markup.

A real job (started by the real CLI and supervisor) runs with argv[0] set to a title change and a screen clear,
an argv element holding a newline, a thread named with an OSC 52 clipboard write, and a ``thread_error`` event
whose message holds Rich markup. The real dashboard, in a real tmux server with ``set-clipboard on``, draws that
run: its pane keeps its title, no tmux buffer appears, the screen is never cleared, the sequences show as visible
signs, and the markup shows literally; the dashboard also survives its agent being killed and the reconnect.
``status`` printed to a pty shows the same strings, neutralised. A control pane that prints the sequences raw
proves the server would have obeyed them.
"""

from __future__ import annotations

import contextlib
import os
import pty
import select
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.waiting import wait_until

from engine.supervisor import records

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]
REPO = Path(__file__).resolve().parents[2]
SESSION = "specdec-hostile-text"
TITLE = "viewer-title"

ARGV0 = "\x1b]0;X\x07\x1b[2J"  # a title change, then a screen clear
CLIPBOARD_THREAD = "\x1b]52;c;SGk=\x07"  # OSC 52: write "Hi" into the clipboard (12 bytes: fits a thread name)
SPLIT_ARG = "a\nb"
MARKUP = "[/data] and [@click=app.quit]"
SEQUENCES = ("\x1b]0;", "\x1b[2J", "\x1b]52;", "\x07")

JOB = r"""
import ctypes, json, os, threading, time
libc = ctypes.CDLL(None, use_errno=True)
def named():
    libc.prctl(15, {thread!r}, 0, 0, 0)  # PR_SET_NAME
    time.sleep(600)
threading.Thread(target=named, daemon=True).start()
with open(os.environ["SPECDEC_EVENTS"], "a") as fh:
    fh.write(json.dumps({{"t": time.time(), "kind": "thread_error", "thread": "drafter-0",
                         "exc_type": "RuntimeError", "message": {markup!r}, "policy": "continue"}}) + "\n")
print("hostile job up", flush=True)
time.sleep(600)
"""


def tmux(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["tmux", "-L", os.environ["SPECDEC_TMUX_SOCKET"], *args], capture_output=True, text=True, timeout=10
    )


def capture(session: str = SESSION) -> str:
    return tmux("capture-pane", "-p", "-e", "-t", session).stdout


def pane_title(session: str = SESSION) -> str:
    return tmux("display-message", "-p", "-t", session, "#{pane_title}").stdout.strip()


def buffers() -> str:
    return tmux("list-buffers").stdout.strip()


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


@pytest.fixture
def hostile_run(run_root: Path, tmp_path: Path) -> Iterator[Path]:
    """A running job with hostile argv, thread name and thread_error event; killed by its recorded groups after."""
    job = tmp_path / "job.py"
    job.write_text(JOB.format(thread=CLIPBOARD_THREAD.encode(), markup=MARKUP))
    # argv[0] carries the newline too: the pane shows only the start of a long command line.
    command = ["bash", "-c", 'exec -a "$0" "$1" "$2"', ARGV0 + SPLIT_ARG, sys.executable, str(job)]
    done = subprocess.run(
        [sys.executable, "-m", "tui", "launch", "local", "--run-root", str(run_root), "--python", sys.executable,
         "--wait", "output", "--", *command],
        capture_output=True, text=True, timeout=60, env=cli_env(SPECDEC_NO_TMUX="1"), cwd=str(REPO), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir = records.current_run_dir(run_root)
    assert run_dir is not None
    try:
        yield run_root
    finally:
        launch = records.read_json(run_dir / records.LAUNCH_JSON) or {}
        for key in ("job_pgid", "pgid"):
            pgid = launch.get(key)
            if isinstance(pgid, int) and pgid > 1:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)


@pytest.fixture
def clipboard_server() -> Iterator[None]:
    tmux("kill-server")

    def started() -> bool:
        # A server still exiting from the kill above answers "server exited unexpectedly": ask again.
        made = tmux("new-session", "-d", "-s", "specdec-control", "-x", "80", "-y", "10", "sleep 600")
        return made.returncode == 0

    wait_until(started, 10, "a fresh tmux server for the control pane")
    tmux("set-option", "-s", "set-clipboard", "on")
    try:
        yield
    finally:
        tmux("kill-server")


def test_the_server_obeys_the_sequences_when_a_pane_prints_them_raw(clipboard_server: None) -> None:
    raw = shlex.quote(ARGV0 + CLIPBOARD_THREAD)
    tmux("new-session", "-d", "-s", "specdec-raw", "-x", "80", "-y", "10", f"printf %s {raw}; sleep 600")
    wait_until(lambda: pane_title("specdec-raw") == "X" and buffers(), 10, "the raw pane to set title and buffer")
    assert "Hi" in tmux("show-buffer").stdout


def _agent_pid_of(parent: int) -> int | None:
    """The agent process the dashboard (pid ``parent``) spawned: found by its parent pid and its argv."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"engine.agent.main" in argv:
            return int(entry)
    return None


def _clean(screen: str) -> None:
    for seq in SEQUENCES:
        assert seq not in screen, f"{seq!r} reached the pane"


def test_the_dashboard_draws_hostile_host_text_inert_and_stays_up(
    hostile_run: Path, clipboard_server: None, tui_config_dir: Path
) -> None:
    argv = [sys.executable, "-m", "tui", "connect", "local", "--run-root", str(hostile_run), "--python", sys.executable]
    env = {
        "SPECDEC_TUI_CONFIG_DIR": str(tui_config_dir),
        "SPECDEC_TMUX_SOCKET": os.environ["SPECDEC_TMUX_SOCKET"],
        "PYTHONPATH": str(REPO),
        "TERM": "xterm-256color",
        "TEXTUAL_ANIMATIONS": "none",
        "LANG": "C.UTF-8",
    }
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    command = f"env -u TMUX -u COLUMNS -u LINES {assignments} {shlex.join(argv)}"
    made = tmux("new-session", "-d", "-s", SESSION, "-x", "200", "-y", "50", "-c", str(REPO), command)
    assert made.returncode == 0, made.stderr
    tmux("set-option", "-t", SESSION, "remain-on-exit", "on")
    tmux("select-pane", "-t", SESSION, "-T", TITLE)
    dashboard_pid = int(tmux("display-message", "-p", "-t", SESSION, "#{pane_pid}").stdout)

    def screen() -> str:
        return capture()

    # argv[0] drawn as signs (the process pane), the thread's name too, the markup literally (the notice).
    wait_until(lambda: "␛]0;X␇␛[2J" in screen(), 30, "the hostile argv in the process pane", observe=screen)
    wait_until(lambda: "␛]52;c;SGk=␇" in screen(), 30, "the hostile thread name", observe=screen)
    wait_until(
        lambda: "[/data]" in screen() and "[@click=app.quit]" in screen(), 30, "the markup, literally", observe=screen
    )
    assert "␛[2Ja⏎b" in screen(), screen()
    _clean(screen())
    assert pane_title() == TITLE
    assert buffers() == ""

    agent = _agent_pid_of(dashboard_pid)
    assert agent is not None
    os.kill(agent, signal.SIGKILL)
    wait_until(lambda: (_agent_pid_of(dashboard_pid) or agent) != agent, 30, "a new agent after the reconnect")
    wait_until(lambda: "● connected" in screen() and "␛]0;X␇" in screen(), 30, "the reconnected view", observe=screen)
    dead = tmux("display-message", "-p", "-t", SESSION, "#{pane_dead}").stdout.strip()
    assert dead == "0", screen()
    _clean(screen())
    assert pane_title() == TITLE
    assert buffers() == ""


def _read_pty(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, bytes]:
    """Run ``argv`` with a pty as its stdout and stderr; (exit status, every byte it wrote)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env, cwd=str(REPO))
    os.close(follower)
    out = bytearray()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: every writer closed the pty
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    return proc.wait(timeout=10), bytes(out)


def test_status_on_a_terminal_prints_hostile_host_text_inert(hostile_run: Path) -> None:
    argv = [sys.executable, "-m", "tui", "status", "local", "--run-root", str(hostile_run), "--python", sys.executable]
    rc, out = _read_pty(argv, cli_env(), 60.0)
    text = out.decode("utf-8", "replace")
    assert rc == 0, text
    assert b"\x1b" not in out and b"\x07" not in out, text
    assert "␛]0;X␇␛[2J" in text, text
    command_rows = [line for line in text.splitlines() if "␛]0;X" in line]
    assert any("␛[2Ja⏎b" in line for line in command_rows), text  # the newline did not split the row
