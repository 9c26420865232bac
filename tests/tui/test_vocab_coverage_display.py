"""The draft vocabulary's coverage of the trained tokens (the ``data`` stage's ``vocab_coverage``) reaches the
dashboard: decoded from the engine line, shown on the timeline, and a warning notice below 90 %."""

from __future__ import annotations

from typing import Any

from textual.app import App, ComposeResult

from engine import protocol
from tui.dashboard.state import DashboardState
from tui.dashboard.widgets.run_timeline import RunTimeline
from tui.link.events import decode


def data_stage(offset: int, coverage: float) -> dict[str, Any]:
    detail = f"draft vocabulary: the 128 most frequent token ids over the whole training set; it holds {coverage:.1%}"
    event = {"t": 1000.0, "kind": "stage", "stage": "data", "detail": detail, "vocab_coverage": coverage}
    return {"ev": "engine", "offset": offset, "inode": 7, "run_id": "r1", "event": event}


class _Timeline(App[None]):
    def __init__(self, state: DashboardState) -> None:
        super().__init__()
        self.state = state

    def compose(self) -> ComposeResult:
        yield RunTimeline(self.state.timeline, id="timeline")


async def test_the_timeline_shows_the_coverage_and_a_low_one_is_a_warning() -> None:
    line = decode(data_stage(100, 0.874))
    assert isinstance(line, protocol.EngineLineEvent) and isinstance(line.event, protocol.StageEvent)
    assert line.event.vocab_coverage == 0.874  # the decoder keeps the field

    state = DashboardState("root@gpu-box")
    state.ingest(decode({"ev": "run", "run": {"run_id": "r1", "run_dir": "/r", "state": "running"}}))
    state.ingest(line)
    assert state.timeline.vocab_coverage == 0.874 and "timeline" in state.dirty
    assert [
        (kind, text.endswith("(below 90%: the drafter cannot propose the rest)")) for kind, text in state.notices
    ] == [("warning", True)]
    app = _Timeline(state)
    async with app.run_test(size=(200, 6)) as pilot:
        await pilot.pause()
        low = app.query_one(RunTimeline).render().plain  # type: ignore[union-attr]
    assert "stage data   draft vocab holds 87.4% of trained tokens (low)" in low

    state.ingest(decode(data_stage(200, 0.962)))
    assert len(state.notices) == 1  # a coverage above 90 % is no warning
    app = _Timeline(state)
    async with app.run_test(size=(200, 6)) as pilot:
        await pilot.pause()
        good = app.query_one(RunTimeline).render().plain  # type: ignore[union-attr]
    assert "draft vocab holds 96.2% of trained tokens" in good and "(low)" not in good
