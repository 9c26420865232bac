"""The help screen keeps its columns at a narrow width: a long description wraps under itself, never
back into the key column."""

from __future__ import annotations

from collections.abc import Callable

from support.pilot import wait_until
from textual.geometry import Region
from tui_recorded import RecordingSession

from tui.dashboard.app import DashboardApp
from tui.dashboard.screens.help import HelpScreen

NARROW = (64, 40)


async def test_long_descriptions_wrap_within_their_own_column(recorded_app: Callable[..., DashboardApp]) -> None:
    app = recorded_app(RecordingSession())
    async with app.run_test(size=NARROW) as pilot:
        await pilot.press("question_mark")
        await wait_until(pilot, lambda: isinstance(app.screen, HelpScreen))
        screen = app.screen
        assert isinstance(screen, HelpScreen)
        rows = screen.rows()
        table = screen.query_one("#help-table")
        width, height = table.size
        lines = [strip.text for strip in table.render_lines(Region(0, 0, width, height))]
        lines = [line.rstrip() for line in lines if line.strip()]
        keys = {key for key, _, _ in rows}
        key_w = max(len(k) for k in keys)
        assert len(lines) > len(rows), "at this width some description must wrap"
        for line in lines:
            in_key_column = line[:key_w].strip()
            assert in_key_column in keys or not in_key_column, f"description text in the key column: {line!r}"
        # every word of every description is shown (wrapped, not cut)
        shown = " ".join(lines).split()
        for _, _, what in rows:
            for word in what.split():
                assert word in shown, f"{word!r} of {what!r} is missing"
