"""Every key path of the dashboard, on recorded agent events with a session that records requests.

The paths that must touch a real host (launch, kill-stale, quit leaving the run alive) are also
covered against a real local agent in test_dashboard_live.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from support.pilot import wait_until
from textual.color import Color
from textual.drivers.headless_driver import HeadlessDriver
from textual.widgets import Button, Input
from tui_recorded import RUN_ID, T0, RecordingSession, healthy_events, log_events, run

from tui.dashboard import theming
from tui.dashboard.app import DashboardApp
from tui.dashboard.messages import ConnectionChanged
from tui.dashboard.screens.confirm import ConfirmScreen
from tui.dashboard.screens.help import HelpScreen
from tui.dashboard.screens.stacks import StacksScreen
from tui.dashboard.widgets.log_tail import LogTail
from tui.link.transport import ConnectOptions
from tui.profiles import Profile
from tui.relaunch import launch_spec

SIZE = (140, 44)
LAUNCH_REPLY = {"run_id": "20261129-120000-cd34", "run_dir": "/r", "tmux_session": "specdec-x", "attachable": True}


def notifications(app: DashboardApp) -> list[str]:
    """What the app told the user, oldest first."""
    return [str(n.message) for n in app._notifications]


def session_with_run() -> RecordingSession:
    return RecordingSession(
        replies={
            "launch": LAUNCH_REPLY,
            "stop": {"stopped": True, "steps": ["SIGTERM"]},
            "restart": {"previous_run_id": RUN_ID, "stop": {"stopped": True}, "launch": LAUNCH_REPLY},
        }
    )


def started(app: DashboardApp, session: RecordingSession) -> None:
    session.emit(*healthy_events())
    app.flush_events(force_charts=True)


async def test_launch_sends_the_profiles_spec(recorded_app: Callable[..., DashboardApp]) -> None:
    session = session_with_run()
    profile = Profile(name="demo", command=["bash", "start_training.sh"], cwd="/root/work", env={"A": "1"})
    app = recorded_app(session, profile=profile)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("l")
        await wait_until(pilot, lambda: "launch" in session.commands(), what="launch request")
        _, args = session.requests[-1]
        assert args["command"] == ["bash", "start_training.sh"]
        assert args["cwd"] == "/root/work" and args["env"] == {"A": "1"} and args["profile"] == "demo"


async def test_l_while_a_run_is_live_asks_before_a_second_run_hides_it(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    """A second launch becomes the current run and the live one goes on out of sight: `l` asks first, naming it."""
    session = session_with_run()
    app = recorded_app(session, profile=Profile(name="demo", command=["bash", "start_training.sh"]))
    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        await pilot.press("l")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        body = str(app.screen.query_one("#confirm-body").render())
        assert f"run {RUN_ID}" in body and "is still running" in body and f"stop --run {RUN_ID}" in body, body
        assert session.requests == []  # nothing is sent before the answer
        await pilot.press("n")
        await wait_until(pilot, lambda: not isinstance(app.screen, ConfirmScreen))
        assert session.requests == []
        await pilot.press("l")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        await wait_until(pilot, lambda: "launch" in session.commands(), what="launch request")
        assert session.requests[-1][1]["command"] == ["bash", "start_training.sh"]


async def test_restart_confirmed_asks_the_agent_to_relaunch_the_recorded_spec(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    session = session_with_run()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        await pilot.press("r")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        body = str(app.screen.query_one("#confirm-body").render())
        assert "python3 -m engine.trainer --preset cpu-demo" in body  # the command the run recorded
        assert session.requests == []  # nothing is sent before the answer
        await pilot.press("y")
        said = f"restarted: run {LAUNCH_REPLY['run_id']} (was {RUN_ID})"
        await wait_until(pilot, lambda: said in notifications(app), what="the restart reply, on screen")
        # One command: the agent stops the run and launches the spec it recorded (the CLI's restart does the same).
        assert session.commands() == ["restart"]
        assert session.requests[0][1]["grace_s"] == 30.0
        assert session.requests[0][1]["run_id"] == RUN_ID  # the run shown, by its id: never one current since


async def test_restart_without_a_run_sends_nothing_and_says_why(recorded_app: Callable[..., DashboardApp]) -> None:
    session = session_with_run()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("r")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen) and session.requests == []
        assert any("nothing to restart" in str(n.message) for n in app._notifications)


async def test_restart_cancelled_sends_nothing(recorded_app: Callable[..., DashboardApp]) -> None:
    session = session_with_run()
    app = recorded_app(session)

    def cancels() -> int:
        return notifications(app).count("Restart the run: cancelled")

    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        await pilot.press("r")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("escape")
        await wait_until(pilot, lambda: cancels() == 1, what="the cancel, on screen")
        assert not isinstance(app.screen, ConfirmScreen)
        # a stray Enter on the dialog is a cancel too: the safe button has the focus
        await pilot.press("r")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        focused = app.screen.focused
        assert isinstance(focused, Button) and focused.id == "choice-no"
        await pilot.press("enter")
        await wait_until(pilot, lambda: cancels() == 2, what="the second cancel, on screen")
        assert session.requests == []


async def test_stop_asks_then_stops(recorded_app: Callable[..., DashboardApp]) -> None:
    session = session_with_run()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        await pilot.press("s")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert session.requests == []
        await pilot.click("#choice-yes")
        await wait_until(pilot, lambda: session.commands() == ["stop"])
        assert session.requests[0][1]["run_id"] == RUN_ID  # the run shown, by its id: never one current since


async def test_kill_stale_lists_then_signals_exactly_the_listed_pids(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    candidates = [
        {
            "pid": 901,
            "create_time": 1700.5,
            "user": "alice",
            "cmd": "python old_train.py",
            "gpus": [0],
            "used_mib": 30_000.0,
            "resolved": True,
            "state": "sleeping",
            "age_s": 86400.0,
        },
        {
            "pid": 902,
            "create_time": 1701.25,
            "user": "bob",
            "cmd": "python eval.py",
            "gpus": [1],
            "used_mib": 2_000.0,
            "resolved": True,
            "state": "running",
            "age_s": 600.0,
        },
        {
            "pid": 77777,
            "create_time": None,
            "user": None,
            "cmd": None,
            "gpus": [1],
            "used_mib": 512.0,
            "resolved": False,
            "source": "nvml",
        },
    ]

    def kill_stale(args: dict[str, Any]) -> dict[str, Any]:
        if args["dry_run"]:
            return {"candidates": candidates, "signalled": [], "failed": []}
        return {"candidates": candidates, "signalled": args["targets"], "failed": []}

    session = RecordingSession(replies={"kill_stale": kill_stale})
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        await pilot.press("k")
        await wait_until(pilot, lambda: type(app.screen).__name__ == "KillStaleScreen")
        table = app.screen.query_one("#kill-table")
        rows = [table.get_row_at(i) for i in range(table.row_count)]  # type: ignore[attr-defined]
        assert [r[0] for r in rows] == ["901", "902", "77777"]
        assert rows[0][1] == "alice" and rows[0][3] == "30000 MiB" and "old_train.py" in rows[0][6]
        assert session.requests == [("kill_stale", {"dry_run": True, "targets": None})]
        await pilot.press("y")
        await wait_until(pilot, lambda: len(session.requests) == 2)
        # the unresolvable NVML pid is shown but never sent
        assert session.requests[1] == ("kill_stale", {"dry_run": False, "targets": [[901, 1700.5], [902, 1701.25]]})


async def test_kill_stale_cancel_signals_nothing(recorded_app: Callable[..., DashboardApp]) -> None:
    candidates = [{"pid": 901, "create_time": 1700.5, "user": "alice", "cmd": "x", "gpus": [0], "resolved": True}]
    session = RecordingSession(replies={"kill_stale": {"candidates": candidates, "signalled": [], "failed": []}})
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("k")
        await wait_until(pilot, lambda: type(app.screen).__name__ == "KillStaleScreen")
        await pilot.press("n")
        await wait_until(pilot, lambda: type(app.screen).__name__ == "DashboardScreen")
        assert [args["dry_run"] for _, args in session.requests] == [True]


async def test_filter_shows_only_matching_lines_and_highlights_errors(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    session = RecordingSession()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        lines = [f"step={i} loss=2.0" for i in range(50)] + ["Traceback (most recent call last):", "ValueError: x"]
        events, _ = log_events(lines)
        session.emit(*events)
        app.flush_events()
        tail = app.query_one(LogTail)
        assert tail.line_count == 52
        tail_height = tail.size.height
        await pilot.press("slash")
        box = app.query_one("#log-filter", Input)
        assert box.has_focus
        await pilot.pause()
        # the box takes the status line's row: the tail keeps its size (no re-render of the whole tail)
        assert box.region.height == 1 and not app.query_one("#log-status").display
        assert tail.size.height == tail_height
        await pilot.press(*"step=4", "enter")
        assert tail.lines == [f"step={i} loss=2.0" for i in (4, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49)]
        # new lines obey the filter too
        more, _ = log_events(["step=400 loss=1.0", "unrelated"], start=10_000)
        session.emit(*more)
        app.flush_events()
        assert tail.lines[-1] == "step=400 loss=1.0"
        await pilot.press("slash", *["backspace"] * 6, "enter")
        assert tail.line_count == 52 + 1 + 2  # everything, plus the gap marker
        error_style = tail.get_component_rich_style("log-tail--error")
        strip = tail._render_line_strip(50, tail.rich_style)  # the Traceback line
        assert any(seg.style and seg.style.color == error_style.color for seg in strip)


async def test_lines_that_arrive_between_two_flushes_are_shown_once_after_a_filter_is_applied_or_cleared(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    """A filter redraws every line the model holds; lines taken in since the last flush were then drawn again by
    the next flush (5 of 6 tries on a live run, whose log grows between any two flushes)."""
    session = RecordingSession()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        events, end = log_events([f"step={i}" for i in range(5)])
        session.emit(*events)
        app.flush_events()
        tail = app.query_one(LogTail)
        more, end = log_events(["step=5", "step=6"], start=end)
        session.emit(*more)  # taken in, not drawn yet
        await pilot.press("slash", *"step", "enter")
        app.flush_events()
        assert tail.lines == [f"step={i}" for i in range(7)]
        more, _ = log_events(["step=7"], start=end)
        session.emit(*more)
        await pilot.press("slash", *["backspace"] * 4, "enter")  # cleared
        app.flush_events()
        assert tail.lines == [f"step={i}" for i in range(8)]


async def test_engine_events_from_before_the_dashboard_opened_are_drawn_but_not_announced(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    session = RecordingSession()
    assert session.agent is not None
    session.agent.t = T0 + 100.0  # the host's clock when its agent said hello
    app = recorded_app(session)

    def engine(offset: int, t: float, **event: Any) -> dict[str, Any]:
        return {"ev": "engine", "offset": offset, "run_id": RUN_ID, "event": {"t": t, **event}}

    async with app.run_test(size=SIZE) as pilot:
        session.emit(
            engine(100, T0 + 50, kind="export", path="/srv/old", format="eagle3", step=3),
            engine(200, T0 + 60, kind="run_end", ok=True, reason="steps done", step=3),
        )
        app.flush_events()
        await pilot.pause()
        assert app.state.timeline.last_export == "/srv/old"  # drawn: it is the run's history
        assert not [n for n in notifications(app) if "exported" in n or "finished" in n], notifications(app)
        session.emit(engine(300, T0 + 101, kind="run_end", ok=False, reason="boom", step=4))
        app.flush_events()
        await wait_until(pilot, lambda: any("engine finished (failed): boom" in n for n in notifications(app)))


async def test_log_stops_following_when_scrolled_up_and_counts_pending(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    session = RecordingSession()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        events, end = log_events([f"line {i}" for i in range(200)])
        session.emit(*events)
        app.flush_events()
        await pilot.pause()
        tail = app.query_one(LogTail)
        assert tail.following and tail.scroll_y == tail.max_scroll_y
        tail.focus()
        await pilot.press("pageup")
        await pilot.pause()
        assert not tail.following
        y = tail.scroll_y
        events, _ = log_events([f"new {i}" for i in range(7)], start=end)
        session.emit(*events)
        app.flush_events()
        await pilot.pause()
        assert tail.pending == 7 and tail.scroll_y == y
        assert "paused: 7 new lines" in str(app.query_one("#log-status").render())
        await pilot.press("f")
        await pilot.pause()
        assert tail.following and tail.pending == 0 and tail.scroll_y == tail.max_scroll_y


async def test_log_keeps_following_when_its_pane_grows(recorded_app: Callable[..., DashboardApp]) -> None:
    """The panes above the log change height as the first samples arrive (GPU rows, processes), and the terminal
    may be resized: a follower stays at the end, and a pane that grows (the scroll position pulled up to the new
    end) is not the reader scrolling up. Seen at 80x24 on the CPU demo: 'paused' from the first second."""
    session = RecordingSession()
    app = recorded_app(session)
    async with app.run_test(size=(80, 24)) as pilot:
        events, _ = log_events([f"line {i}" for i in range(200)])
        session.emit(*events)
        app.flush_events()
        await pilot.pause()
        tail = app.query_one(LogTail)
        session.emit(*healthy_events())  # GPU rows and the processes pane: the log pane shrinks
        app.flush_events()

        def at_end() -> bool:
            return tail.following and tail.scroll_y == tail.max_scroll_y > 0

        await wait_until(pilot, at_end, 5.0, "the log at its end after the first samples")
        for rows in (40, 24, 50):  # taller, shorter, taller again
            await pilot.resize_terminal(80, rows)
            await wait_until(pilot, at_end, 5.0, f"the log following at its end after a resize to 80x{rows}")
        assert "following" in str(app.query_one("#log-status").render())


async def test_theme_switch_changes_and_persists(recorded_app: Callable[..., DashboardApp]) -> None:
    app = recorded_app(RecordingSession())
    async with app.run_test(size=SIZE) as pilot:
        assert app.theme == "specdec-dark"
        await pilot.press("t")
        await pilot.pause()
        assert app.theme != "specdec-dark"
        assert theming.saved_theme() == app.theme
    chosen = theming.saved_theme()
    again = recorded_app(RecordingSession())
    async with again.run_test(size=SIZE):
        assert again.theme == chosen


async def test_help_lists_every_key_with_remaps(recorded_app: Callable[..., DashboardApp]) -> None:
    theming.write_config({"keys": {"restart": "ctrl+r"}})
    session = session_with_run()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        assert isinstance(app.screen, HelpScreen)
        text = " ".join(" ".join(row) for row in app.screen.rows())
        for word in (
            "Launch",
            "Restart",
            "Stop",
            "Kill stale",
            "Attach",
            "Stacks",
            "Past runs",
            "Filter",
            "Theme",
            "Quit",
            "ctrl+r",
        ):
            assert word in text
        await pilot.press("escape")
        await pilot.press("ctrl+r")  # the remapped key works
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))


async def test_help_screen_is_kept_and_follows_a_theme_switch(recorded_app: Callable[..., DashboardApp]) -> None:
    """The help screen is built once (opening it is a key-to-frame path), yet shows the current theme."""
    app = recorded_app(RecordingSession())
    async with app.run_test(size=SIZE) as pilot:

        async def open_help() -> HelpScreen:
            await pilot.press("question_mark")
            await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
            assert isinstance(app.screen, HelpScreen)
            return app.screen

        def title_colour(screen: HelpScreen) -> object:
            return screen.query_one("#help-title").styles.color

        first = await open_help()
        before = title_colour(first)
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        again = await open_help()
        assert again is first  # not composed again
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, HelpScreen))
        await pilot.press("t")
        await wait_until(pilot, lambda: app.theme != "specdec-dark")
        themed = await open_help()
        assert title_colour(themed) != before
        assert title_colour(themed) == Color.parse(app.get_css_variables()["primary"])


async def test_command_palette_offers_every_action(recorded_app: Callable[..., DashboardApp]) -> None:
    app = recorded_app(RecordingSession())
    async with app.run_test(size=SIZE):
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert {
            "Launch",
            "Restart",
            "Stop",
            "Kill stale",
            "Attach",
            "Stacks",
            "Past runs",
            "Filter",
            "Theme",
            "Help",
            "Quit",
        } <= titles


async def test_stacks_screen_shows_every_thread(recorded_app: Callable[..., DashboardApp]) -> None:
    text = "\n".join(f'Thread 0x{i:x} "drafter-{i}":\n  File "worker.py", line {i}' for i in range(60))
    session = RecordingSession(replies={"stacks": {"method": "faulthandler (SIGUSR1)", "text": text}})
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("d")
        await wait_until(pilot, lambda: isinstance(app.screen, StacksScreen))
        assert session.requests == [("stacks", {"timeout_s": 20.0})]
        scroll = app.screen.query_one("#stacks-scroll")
        await wait_until(pilot, lambda: scroll.max_scroll_y > 0, what="the dump, taller than the screen")
        await pilot.press("end")
        await pilot.pause()
        assert scroll.scroll_y > 0
        await pilot.press("escape")


async def test_quit_says_the_run_keeps_running(recorded_app: Callable[..., DashboardApp]) -> None:
    session = session_with_run()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    assert session.closed
    assert "stop" not in session.commands()
    assert app.exit_message is not None and f"Run {RUN_ID} keeps running" in app.exit_message


class SuspendableDriver(HeadlessDriver):
    """A headless driver that can hand the terminal over, as a real terminal driver does."""

    suspended = 0
    resumed = 0

    @property
    def can_suspend(self) -> bool:
        return True

    def suspend_application_mode(self) -> None:
        type(self).suspended += 1

    def resume_application_mode(self) -> None:
        type(self).resumed += 1


async def test_attach_suspends_and_runs_the_ssh_command_then_resyncs(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    ran: list[list[str]] = []
    session = RecordingSession(
        replies={"status": {"host": {"hostname": "gpu-box"}, "gpus": [], "processes": {}, "run": None, "anomalies": []}}
    )
    app = recorded_app(session, external_runner=lambda argv: ran.append(argv) or 0)
    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        app._driver.__class__ = SuspendableDriver  # type: ignore[union-attr]
        await pilot.press("a")
        await wait_until(pilot, lambda: "status" in session.commands(), what="resync after attach")
        assert ran == [
            [
                "ssh",
                "-t",
                "-p",
                "22",
                "root@gpu-box",
                "pct",
                "exec",
                "200",
                "--",
                "tmux",
                "attach",
                "-t",
                f"specdec-{RUN_ID}",
            ]
        ]
        assert SuspendableDriver.suspended == 1 and SuspendableDriver.resumed == 1
        await wait_until(pilot, lambda: app.state.run is None, what="status ingested")


async def test_attach_where_suspend_is_unsupported_shows_the_command(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    ran: list[list[str]] = []
    session = RecordingSession()
    app = recorded_app(session, external_runner=lambda argv: ran.append(argv) or 0)
    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        await pilot.press("a")  # the headless test driver cannot suspend
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        body = str(app.screen.query_one("#confirm-body").render())
        assert f"tmux attach -t specdec-{RUN_ID}" in body and "pct exec 200" in body
        assert ran == []


async def test_attach_inside_tmux_offers_a_new_window(
    recorded_app: Callable[..., DashboardApp], monkeypatch: Any
) -> None:
    monkeypatch.setenv("TMUX", "/tmp/tmux-0/default,1,0")
    ran: list[list[str]] = []
    session = RecordingSession()
    app = recorded_app(session, external_runner=lambda argv: ran.append(argv) or 0)
    async with app.run_test(size=SIZE) as pilot:
        started(app, session)
        await pilot.press("a")
        await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("w")
        await wait_until(pilot, lambda: ran)
        assert ran[0][:5] == ["tmux", "new-window", "-n", "specdec-run", "--"]
        assert ran[0][5:] == session.attach_argv(f"specdec-{RUN_ID}")


async def test_connection_loss_shows_at_once_and_reconnect_does_not_double_lines(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    seen: list[ConnectionChanged] = []
    session = RecordingSession()
    app = recorded_app(session)
    hook = lambda m: seen.append(m) if isinstance(m, ConnectionChanged) else None  # noqa: E731
    async with app.run_test(size=SIZE, message_hook=hook) as pilot:
        events, end = log_events([f"line {i}" for i in range(10)])
        session.emit(*events)
        app.flush_events()
        session.state = "reconnecting"
        session.emit({"ev": "connection", "state": "reconnecting", "detail": "link lost: EOF", "attempt": 2})
        await wait_until(pilot, lambda: seen)  # no flush needed
        await pilot.pause()
        header = str(app.query_one("#header").render())
        assert "reconnecting" in header and "attempt 2" in header
        session.state = "connected"
        session.emit({"ev": "connection", "state": "connected", "detail": "", "attempt": 2})
        session.emit(*events[5:])  # the resumed stream overlaps what we had
        more, _ = log_events(["line 10"], start=end)
        session.emit(*more)
        app.flush_events()
        tail = app.query_one(LogTail)
        assert tail.lines == [f"line {i}" for i in range(11)]


async def test_run_failure_shows_its_cause(recorded_app: Callable[..., DashboardApp]) -> None:
    session = RecordingSession()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        session.emit(run(state="failed", exit_code=2, milestones={"submitted": 1.0, "started": 1.2}))
        session.emit(
            {
                "ev": "milestone",
                "run_id": RUN_ID,
                "milestone": "output",
                "t": 1.4,
                "ok": False,
                "cause": "process exited with code 2 before writing output: bash: start.sh: No such file",
            }
        )
        app.flush_events()
        await pilot.pause()
        timeline = str(app.query_one("#timeline").render())
        assert "✗ output" in timeline and "No such file" in timeline


def test_launch_spec_of_a_profile_without_a_command_starts_the_engine_by_the_agents_interpreter() -> None:
    """``connect`` hands the dashboard the typed ``Profile``; without a command it launches our engine."""
    session = RecordingSession()
    assert session.agent is not None
    session.agent.python_path = "/usr/bin/python3"
    session.engine_pythonpath = "/root/.cache/specdec/engine-abc"
    spec = launch_spec(Profile(name="default"), session)
    assert spec.command[:3] == ["/usr/bin/python3", "-m", "engine.trainer"]
    assert "--preset" in spec.command and spec.profile == "default"
    assert spec.env["PYTHONPATH"] == "/root/.cache/specdec/engine-abc"
    assert spec.deadlines_s is not None and spec.deadlines_s["first-step"] > 0
    foreign = launch_spec(Profile(name="mine", command=["bash", "run.sh"], cwd="/w"), session, cwd="/elsewhere")
    assert (foreign.command, foreign.cwd, foreign.profile) == (["bash", "run.sh"], "/elsewhere", "mine")
    assert foreign.env == {}  # a command of its own gets no engine PYTHONPATH


async def test_l_without_a_profile_launches_the_one_the_command_line_named(
    recorded_app: Callable[..., DashboardApp], tmp_path: Path
) -> None:
    """No profile given to the app: ``l`` reads ``--profile`` in ``--config`` from the session's options."""
    config = tmp_path / "config.toml"
    config.write_text('[profiles.mine]\ncommand = ["bash", "mine.sh"]\ncwd = "/w"\n')
    session = session_with_run()
    session.opts = ConnectOptions(profile="mine", config=str(config))
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("l")
        await wait_until(pilot, lambda: "launch" in session.commands(), what="launch request")
        _, args = session.requests[-1]
        assert (args["command"], args["cwd"], args["profile"]) == (["bash", "mine.sh"], "/w", "mine")


async def test_anomaly_badge_explains_itself_on_focus(recorded_app: Callable[..., DashboardApp]) -> None:
    from tui_recorded import gpu, gpus_event

    session = RecordingSession()
    app = recorded_app(session)
    message = "GPU 0 reports 100% utilization with 0 MiB used and no process holding it"
    async with app.run_test(size=SIZE) as pilot:
        session.emit(gpus_event([gpu(0, 100, 0)]), {"ev": "anomalies", "items": [
            {"kind": "phantom_utilization", "gpu": 0, "message": message}]})  # fmt: skip
        app.flush_events()
        badge = await wait_until(pilot, lambda: app.query("AnomalyBadge"), what="badge")
        explain = app.query_one("#gpu-explain")
        assert not explain.display or not explain.has_class("-on")
        badge.first().focus()
        await pilot.pause()
        assert explain.has_class("-on") and message in str(explain.render())
        assert badge.first().tooltip == message


async def test_a_run_that_failed_after_its_milestones_shows_the_hosts_root_cause(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    cause = "torchrun: rank 1 (local_rank 1) exited with code 1: RuntimeError: boom; exit code 1; last step 30"
    session = RecordingSession()
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        session.emit(run(state="failed", exit_code=1, cause=cause))
        app.flush_events()
        await pilot.pause()
        timeline = str(app.query_one("#timeline").render())
        assert f"cause: run failed: {cause}" in timeline, timeline


PAST_RUNS = {
    "runs": [
        {
            **run(state="exited", exit_code=0)["run"],
            "run_id": "20261201-110000-bbbb",
            "duration_s": 65.0,
            "current": True,
        },
        {
            **run(state="failed", exit_code=1)["run"],
            "run_id": "20261201-100000-aaaa",
            "cause": "RuntimeError: rank 1 exploded at step 30; exit code 1; last step 30",
            "last_step": 30,
            "duration_s": 12.0,
            "current": False,
        },
    ],
    "total": 2,
}


async def test_runs_key_lists_past_runs_and_shows_the_highlighted_ones_cause_and_log_tail(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    from tui.dashboard.screens.runs import RunsScreen

    def tail(args: dict[str, Any]) -> dict[str, Any]:
        return {"lines": [f"{args['run_id']} line {i}" for i in range(3)], "offset": 42, "run_id": args["run_id"]}

    session = RecordingSession(replies={"runs": PAST_RUNS, "tail": tail})
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("p")
        await wait_until(pilot, lambda: isinstance(app.screen, RunsScreen), what="the runs screen")
        screen = app.screen
        assert isinstance(screen, RunsScreen)
        await wait_until(pilot, lambda: screen.shown == "20261201-110000-bbbb", what="the newest run's detail")
        await pilot.press("down")
        await wait_until(pilot, lambda: screen.shown == "20261201-100000-aaaa", what="the past run's detail")
        detail = str(screen.query_one("#run-detail").render())
        assert "cause: RuntimeError: rank 1 exploded at step 30; exit code 1; last step 30" in detail, detail
        assert "20261201-100000-aaaa line 2" in detail
        assert ("tail", {"n": 200, "run_id": "20261201-100000-aaaa"}) in session.requests
        await pilot.press("escape")
        await wait_until(pilot, lambda: not isinstance(app.screen, RunsScreen), what="the screen to close")


def test_every_key_action_has_exactly_one_owner_and_the_app_keeps_only_routing() -> None:
    from tui.dashboard import keys

    app = DashboardApp(RecordingSession(), connect=False, flush_interval_s=None)
    assert set(app.actions) == {spec.action for spec in keys.KEY_TABLE}
    owners = {name: type(getattr(handler, "__self__", None)).__name__ for name, handler in app.actions.items()}
    assert owners["restart"] == owners["attach"] == "RunControl" and owners["filter"] == "ViewControl"
    assert not [name for name in dir(DashboardApp) if name.startswith("action_") and name[7:] in app.actions]
