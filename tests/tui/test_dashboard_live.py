"""The dashboard against a real local agent: simulated GPUs, a temp run root, a private tmux socket.

Launch, kill-stale and quit go through the real session, the real agent and real processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.pilot import wait_until
from support.procfs import pid_alive
from support.waiting import wait_until_async

from engine.protocol import to_jsonable
from tui.dashboard.app import DashboardApp
from tui.dashboard.screens.kill_stale import KillStaleScreen
from tui.link.events import ConnectionEvent
from tui.profiles import Profile

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")

SIZE = (140, 44)
STEP_SCRIPT = (
    "import time\n"
    "for i in range(100000):\n"
    "    print(f'step={i} loss={2.0 / (i + 1):.4f} {1000 + i} tok/s', flush=True)\n"
    "    time.sleep(0.05)\n"
)
HOLD = "import sys, time\nf = open(sys.argv[1])\nprint('holding', flush=True)\ntime.sleep(600)\n"


def tmux_has(session_name: str) -> bool:
    sock = os.environ["SPECDEC_TMUX_SOCKET"]
    return subprocess.run(["tmux", "-L", sock, "has-session", "-t", session_name], capture_output=True).returncode == 0


def first_step_ok(app: DashboardApp) -> bool:
    state = app.state.timeline.milestones.get("first-step")
    return state is not None and state.ok is True


async def launch_and_watch(app: DashboardApp, pilot: Any) -> dict[str, Any]:
    await wait_until(pilot, lambda: app.state.gpus is not None, 15, "first GPU sample")
    await pilot.press("l")
    await wait_until(pilot, lambda: app.state.run and app.state.run.state == "running", 20, "run running")
    await wait_until(pilot, lambda: app.state.log.total_lines >= 5, 20, "log lines")
    await wait_until(pilot, lambda: app.state.procs and app.state.procs.run_tree, 20, "run processes")
    run = app.state.run
    assert run is not None
    return to_jsonable(run)  # type: ignore[no-any-return]


async def test_launch_key_starts_a_real_run_and_every_pane_fills(
    local_session_factory: Callable[..., Any], cleanup_runs: list[dict[str, Any]]
) -> None:
    session = local_session_factory()
    app = DashboardApp(session, profile=Profile(name="steps", command=[sys.executable, "-c", STEP_SCRIPT]))
    try:
        async with app.run_test(size=SIZE) as pilot:
            run = await launch_and_watch(app, pilot)
            cleanup_runs.append(run)
            assert run["command"][0] == sys.executable
            assert pid_alive(run["pid"])
            await wait_until(pilot, lambda: app.state.charts.series.get(("step", "log")), 10, "chart points")
            await wait_until(pilot, lambda: first_step_ok(app), 20, "first-step")
            app.flush_events(force_charts=True)
            await pilot.pause()
            assert "SIMULATED" in str(app.query_one("#header").render())
            assert app.query_one("#gpu-row-0") is not None
            assert "step=" in "\n".join(app.query_one("#log-tail").lines)  # type: ignore[attr-defined]
            timeline = str(app.query_one("#timeline").render())
            assert "● first-step" in timeline
    finally:
        await session.close()


async def test_quit_leaves_the_run_alive(
    local_session_factory: Callable[..., Any], cleanup_runs: list[dict[str, Any]]
) -> None:
    session = local_session_factory()
    app = DashboardApp(session, profile=Profile(name="steps", command=[sys.executable, "-c", STEP_SCRIPT]))
    async with app.run_test(size=SIZE) as pilot:
        run = await launch_and_watch(app, pilot)
        cleanup_runs.append(run)
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    assert session.state == "disconnected"
    assert app.exit_message and "keeps running" in app.exit_message
    assert pid_alive(run["pid"])
    assert tmux_has(run["tmux_session"])
    log = Path(run["run_dir"]) / "output.log"
    size = log.stat().st_size
    await wait_until_async(lambda: log.stat().st_size > size, 5, "the job to keep writing after we left")


async def test_kill_stale_lists_exactly_the_stale_holders_and_signals_only_after_confirm(
    local_session_factory: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).write_text("")
    monkeypatch.setenv("SPECDEC_DEV_DIR", str(dev))
    spawned: list[subprocess.Popen[bytes]] = []

    def spawn(*argv: str) -> int:
        proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        spawned.append(proc)
        return proc.pid

    stale = {spawn("-c", HOLD, str(dev / "nvidia0")), spawn("-c", HOLD, str(dev / "nvidia1"))}
    decoy = spawn("-c", "import time; time.sleep(600)")
    session = local_session_factory()
    app = DashboardApp(session)
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: session.state == "connected", 15, "connected")
            await wait_until(
                pilot,
                lambda: stale <= {h.pid for h in (app.state.procs.holders if app.state.procs else [])},
                15,
                "holders in the procs stream",
            )
            await pilot.press("k")
            await wait_until(pilot, lambda: isinstance(app.screen, KillStaleScreen), 15, "kill-stale modal")
            screen = app.screen
            assert isinstance(screen, KillStaleScreen)
            assert {c.pid for c in screen.candidates} == stale
            assert {t[0] for t in screen.targets} == stale
            table = screen.query_one("#kill-table")
            assert {int(table.get_row_at(i)[0]) for i in range(table.row_count)} == stale  # type: ignore[attr-defined]
            await pilot.press("n")  # cancel: nothing is signalled
            await wait_until(pilot, lambda: not isinstance(app.screen, KillStaleScreen))
            await pilot.pause(0.3)
            assert all(pid_alive(p) for p in stale)
            await pilot.press("k")
            await wait_until(pilot, lambda: isinstance(app.screen, KillStaleScreen), 15, "kill-stale modal again")
            await pilot.press("y")
            await wait_until(pilot, lambda: not any(pid_alive(p) for p in stale), 20, "stale holders gone")
            assert pid_alive(decoy)
            assert pid_alive(os.getpid())
    finally:
        await session.close()
        for proc in spawned:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


async def test_agent_loss_shows_in_the_header_and_the_resumed_log_has_no_duplicate_or_gap(
    local_session_factory: Callable[..., Any], cleanup_runs: list[dict[str, Any]]
) -> None:
    session = local_session_factory()
    session.backoff_base_s = 0.05  # reconnect quickly in the test
    states: list[str] = []
    session.add_event_listener(lambda ev: states.append(ev.state) if isinstance(ev, ConnectionEvent) else None)
    app = DashboardApp(session, profile=Profile(name="steps", command=[sys.executable, "-c", STEP_SCRIPT]))
    try:
        async with app.run_test(size=SIZE) as pilot:
            run = await launch_and_watch(app, pilot)
            cleanup_runs.append(run)
            agent_pid = session.agent.pid if session.agent else None
            assert isinstance(agent_pid, int)
            os.kill(agent_pid, signal.SIGKILL)
            await wait_until(pilot, lambda: "reconnecting" in states, 10, "reconnecting state")
            await pilot.pause()
            assert "reconnecting" in str(app.query_one("#header").render()) or session.state == "connected"
            await wait_until(pilot, lambda: session.state == "connected" and states[-1] == "connected", 20, "back")
            before = app.state.log.total_lines
            await wait_until(pilot, lambda: app.state.log.total_lines > before + 20, 20, "lines after resume")
            steps = [line for line in app.state.log.lines if line.startswith("step=")]
            numbers = [int(line.split()[0].removeprefix("step=")) for line in steps]
            assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), "a log line was doubled or lost"
            assert app.state.log.gap_bytes == 0
            assert app.state.log.resets == 1  # the one "log created" at launch; the resume adds no reset
    finally:
        await session.close()
