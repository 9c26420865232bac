"""A newcomer's dashboard: the log keeps following across a restart and a relaunch, `f` is in the footer, and at
80x24 the footer still says `? Help` and `q Quit`."""

from __future__ import annotations

from collections.abc import Callable

from support.pilot import wait_until
from tui_recorded import RUN_ID, T0, RecordingSession, engine_events, healthy_events, log_events, run

from tui.dashboard.app import DashboardApp
from tui.dashboard.state import DashboardState
from tui.dashboard.widgets.footer import KeyFooter
from tui.dashboard.widgets.log_tail import LogPane
from tui.link.events import decode

CRASH = {"attempt": 1, "cause": "crash", "at": 1000.0, "exit_code": 1, "detail": "exited with code 1"}


async def test_the_log_follows_again_after_a_restart_and_after_a_relaunch(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    session = RecordingSession()
    app = recorded_app(session)
    async with app.run_test(size=(120, 40)) as pilot:
        session.emit(*healthy_events())
        lines, end = log_events([f"line {i}" for i in range(300)])
        session.emit(*lines)
        app.flush_events(force_charts=True)
        tail = app.query_one(LogPane).tail
        await wait_until(pilot, lambda: tail.max_scroll_y > 0, what="a log longer than its pane")
        tail.scroll_home(animate=False, immediate=True)  # the reader scrolls up: paused
        await wait_until(pilot, lambda: not tail.following, what="the pane to pause")
        # The restart policy starts attempt 2: the pane follows its words.
        session.emit(run(restarts=[CRASH], restart_max=3, restart_state="watching"))
        more, end = log_events([f"attempt 2 line {i}" for i in range(50)], start=end)
        session.emit(*more)
        app.flush_events()
        await wait_until(pilot, lambda: tail.following and tail.pending == 0, what="following after the restart")
        tail.scroll_home(animate=False, immediate=True)
        await wait_until(pilot, lambda: not tail.following, what="the pane to pause again")
        # A relaunch: a new run id, its log from byte 0.
        session.emit(run(run_id=f"{RUN_ID}-2"), {"ev": "log_reset", "inode": 78, "offset": 0, "reason": "created"})
        new, _ = log_events([f"new run line {i}" for i in range(50)], inode=78)
        session.emit(*new)
        app.flush_events()
        await wait_until(pilot, lambda: tail.following and tail.pending == 0, what="following after the relaunch")


async def test_at_80x24_processes_training_log_and_the_footers_help_and_quit_are_visible(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    session = RecordingSession()
    app = recorded_app(session)
    async with app.run_test(size=(80, 24)) as pilot:
        session.emit(*healthy_events())
        app.flush_events(force_charts=True)
        await pilot.pause()
        screen = app.screen
        procs, charts, log = (screen.query_one(w).region for w in ("#procs", "#charts-box", "#log"))
        assert procs.height >= 6 and procs.bottom <= log.y and procs.right <= 80, (procs, log)
        assert charts.height >= 8 and charts.bottom <= log.y, (charts, log)
        assert log.height >= 5 and log.bottom <= 23, log
        footer = app.query_one(KeyFooter)
        text = footer.render().plain  # type: ignore[union-attr]
        assert len(text) <= 80, text
        assert "? Help" in text and "q Quit" in text, text
        assert " f " in text, text
    async with recorded_app(RecordingSession()).run_test(size=(160, 40)) as pilot:
        await pilot.pause()
        wide = pilot.app.query_one(KeyFooter).render().plain  # type: ignore[union-attr]
        assert "f Follow" in wide and "l Launch" in wide, wide


def test_after_a_relaunch_the_old_runs_late_engine_lines_do_not_reach_the_new_runs_panes() -> None:
    state = DashboardState("root@gpu-box")
    state.ingest(decode(run()))
    for raw in engine_events(["drafter0"], 3):
        state.ingest(decode({**raw, "run_id": RUN_ID}))
    assert ("drafter0" in {h.name for h in state.health.threads.values()}) and state.charts.series
    state.ingest(decode(run(run_id=f"{RUN_ID}-2", milestones={"submitted": T0 + 100})))  # connect --launch
    assert not state.health.threads and not state.charts.series
    for raw in engine_events(["drafter0"], 5, start_offset=10_000):  # the old run's last lines, still in flight
        state.ingest(decode({**raw, "run_id": RUN_ID}))
    assert not state.health.threads and not state.charts.series
    for raw in engine_events(["drafter7"], 1):  # the new run's own
        state.ingest(decode({**raw, "run_id": f"{RUN_ID}-2"}))
    assert {h.name for h in state.health.threads.values()} == {"drafter7"}
