"""Characters that draw nothing or reorder what follows (zero-width, direction, C1 controls) are shown as escapes,
never passed through: ``r<U+200B>m`` must not read as ``rm``, ``<U+202E>gnp.exe`` must not read as ``exe.png``.

The one sanitiser (tui/hosttext.py) on each kind of character, then a real job (started by the real CLI and
supervisor) whose argv, thread name and log lines hold them, drawn by the real dashboard (log pane, process and
thread rows) and printed by ``status`` and by ``logs`` on a terminal.
"""

from __future__ import annotations

import asyncio
import os
import pty
import select
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from rich.text import Text
from support.pilot import wait_until

from tui.dashboard.app import DashboardApp
from tui.hosttext import TerminalFilter, printable, printable_lines, printable_rendered
from tui.profiles import Profile

REPO = Path(__file__).resolve().parents[2]
ZERO_WIDTH = "r\u200bm"  # reads as "rm"
SHOWN_ZERO_WIDTH = "r\\u200bm"
REVERSED = "\u202egnp.exe"  # reads as "exe.png"
SHOWN_REVERSED = "\\u202egnp.exe"
INVISIBLE = (
    "\u200b\u200c\u200d\u2060\ufeff\u00ad\u180e\u3164"  # zero-width, joiners, word joiner, BOM, fillers
    "\u202a\u202b\u202c\u202d\u2066\u2067\u2068\u2069\u200e\u200f\u061c"  # embeddings, isolates, marks
    "\U000e0041"  # a tag character
)


@pytest.mark.parametrize("char", [*INVISIBLE, "\x85", "\x9b", "\u2028", "\u2029", "\ud800"], ids=ascii)
def test_each_invisible_direction_or_c1_character_is_shown_as_its_escape(char: str) -> None:
    code = ord(char)
    escape = f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"
    assert printable(f"a{char}b") == f"a{escape}b"
    assert printable_lines(f"a{char}b\nc") == f"a{escape}b\nc"
    out = TerminalFilter()
    assert (out.feed(f"a{char}b\n".encode("utf-8", "surrogatepass")) + out.flush()).decode() in (
        f"a{escape}b\n",
        "a\ufffd\ufffd\ufffdb\n",  # a surrogate is not UTF-8: its bytes are undecodable, each shown as such
    )


def test_control_characters_keep_their_one_character_signs_and_text_stays_text() -> None:
    assert printable("\x1b]0;X\x07\x1b[2Ja\nb\t") == "␛]0;X␇␛[2Ja⏎b\t"
    assert printable_lines("a\r\nb\x1b") == "a\nb␛"
    assert printable("naïve café ß 日本 🙂 א") == "naïve café ß 日本 🙂 א"  # letters of any script pass


def test_a_styled_span_keeps_covering_its_characters_when_an_escape_lengthens_the_text() -> None:
    text = Text()
    text.append("pid ", style="dim")
    text.append(ZERO_WIDTH, style="bold")
    text.append(" cmd", style="red")
    printable_rendered(text, one_line=True)
    assert text.plain == f"pid {SHOWN_ZERO_WIDTH} cmd"
    assert [(text.plain[s.start : s.end], str(s.style)) for s in text.spans] == [
        ("pid ", "dim"),
        (SHOWN_ZERO_WIDTH, "bold"),
        (" cmd", "red"),
    ]


def on_a_terminal(*args: str) -> tuple[int, bytes]:
    """``python -m tui ARGS`` with a pty as its stdout and stderr: (exit status, every byte it wrote)."""
    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "tui", *args]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env, cwd=REPO)
    os.close(follower)
    out = bytearray()
    while chunk := _read(leader):
        out += chunk
    os.close(leader)
    return proc.wait(timeout=30), bytes(out)


def _read(fd: int) -> bytes:
    ready, _, _ = select.select([fd], [], [], 30.0)
    if not ready:
        return b""
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: every writer closed the pty
        return b""


JOB = r"""
import ctypes, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
def named():
    libc.prctl(15, {thread!r}, 0, 0, 0)  # PR_SET_NAME
    time.sleep(600)
threading.Thread(target=named, daemon=True).start()
print("log " + " ".join(sys.argv[1:]) + " c1\x9b", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")
async def test_a_jobs_invisible_characters_are_escapes_in_the_dashboard_status_and_logs(
    local_session_factory: Callable[..., Any],
    cleanup_runs: list[dict[str, Any]],
    tmp_path: Path,
    run_root: Path,
) -> None:
    job = tmp_path / "job.py"
    job.write_text(JOB.format(thread=ZERO_WIDTH.encode()))
    session = local_session_factory()
    # job.py relative to its cwd: the process row must show the argument, not an ellipsis in a long tmp path
    profile = Profile(name="invisible", command=[sys.executable, job.name, ZERO_WIDTH, REVERSED], cwd=str(tmp_path))
    app = DashboardApp(session, profile=profile)
    try:
        async with app.run_test(size=(160, 44)) as pilot:
            await wait_until(pilot, lambda: app.state.gpus is not None, 15, "first GPU sample")
            await pilot.press("l")
            await wait_until(pilot, lambda: app.state.run and app.state.run.state == "running", 20, "run running")
            run = app.state.run
            assert run is not None
            cleanup_runs.append({"run_dir": run.run_dir, "tmux_session": run.tmux_session})
            log = app.query_one("#log-tail")
            await wait_until(pilot, lambda: any(ln.startswith("log ") for ln in log.lines), 20, "the job's line")  # type: ignore[attr-defined]
            line = next(ln for ln in log.lines if ln.startswith("log "))  # type: ignore[attr-defined]
            assert line == f"log {SHOWN_ZERO_WIDTH} {SHOWN_REVERSED} c1\\x9b", line

            procs = app.query_one("#procs")

            def rows() -> str:
                app.flush_events()
                return str(getattr(procs.render(), "plain", ""))

            await wait_until(pilot, lambda: rows().count(SHOWN_ZERO_WIDTH) >= 2, 20, "process and thread rows")
            drawn = rows()
            assert "\u200b" not in drawn and "\u202e" not in drawn, drawn
            assert f"{SHOWN_ZERO_WIDTH} {SHOWN_REVERSED}" in drawn  # the process row: its argv
            assert any(row.lstrip(" ├└").startswith(SHOWN_ZERO_WIDTH) for row in drawn.splitlines()), drawn  # thread

            rc, out = await asyncio.to_thread(on_a_terminal, "status", "local", "--run-root", str(run_root))
            shown = out.decode("utf-8", "replace")
            assert rc == 0, shown
            assert f"{SHOWN_ZERO_WIDTH} {SHOWN_REVERSED}" in shown and "\u200b" not in shown, shown
            rc, out = await asyncio.to_thread(on_a_terminal, "logs", "local", "--run-root", str(run_root), "-n", "5")
            shown = out.decode("utf-8", "replace")
            assert rc == 0, shown
            assert f"log {SHOWN_ZERO_WIDTH} {SHOWN_REVERSED} c1\\x9b" in shown and "\u200b" not in shown, shown
            await pilot.press("q")
    finally:
        await session.close()
