"""The GPUs pane keeps one row per GPU through samples that arrive together, with or without that GPU.

Seen on an H200: a sample without GPUs and one with them landed in one frame; the row removed for the first was
the row the second updated, and the pane showed one blank line until the run ended.
"""

from __future__ import annotations

from textual.app import App, ComposeResult
from textual.widgets import Static

from engine.protocol import Anomaly, GpuInfo, GpusEvent
from tui.dashboard.widgets.gpu_bars import GpuBars, GpuRow
from tui.dashboard.widgets.text_line import TextLine


class Bars(App[None]):
    def compose(self) -> ComposeResult:
        yield GpuBars(id="gpus")


def sample(t: float, *indices: int) -> GpusEvent:
    gpus = [GpuInfo(i, "NVIDIA H200", f"GPU-{i}", 10.0 * t, 1500.0, 143771.0, 40.0, 120.0) for i in indices]
    return GpusEvent(t, gpus, False)


def shown(app: Bars) -> list[str]:
    """The GPU lines on screen (visible rows only)."""
    return [line.text.plain for line in app.query(TextLine) if line.parent is not None and line.parent.display]


async def test_an_empty_sample_and_a_full_one_in_one_frame_leave_the_row() -> None:
    app = Bars()
    async with app.run_test(size=(120, 12)) as pilot:
        bars = app.query_one(GpuBars)
        bars.update_sample(sample(1, 0))
        await pilot.pause()
        bars.update_sample(sample(2))  # no GPU in this one (an NVML hiccup, a status before the first sample)
        bars.update_sample(sample(3, 0))  # and the GPU again, before the next frame
        await pilot.pause()
        lines = shown(app)
        assert len(lines) == 1 and lines[0].startswith("0 H200") and " 30%" in lines[0], lines
        assert len(app.query("#gpu-row-0")) == 1


async def test_a_gpu_gone_from_the_samples_is_not_shown_and_comes_back_in_place() -> None:
    app = Bars()
    async with app.run_test(size=(120, 12)) as pilot:
        bars = app.query_one(GpuBars)
        bars.update_sample(sample(1, 0, 1))
        await pilot.pause()
        bars.update_sample(sample(2, 0))
        await pilot.pause()
        assert [line[:6] for line in shown(app)] == ["0 H200"]
        bars.update_sample(sample(3, 0, 1))
        bars.update_anomalies([Anomaly("phantom_utilization", "busy, no process", gpu=1)])
        await pilot.pause()
        assert [line[:6] for line in shown(app)] == ["0 H200", "1 H200"]
        assert len(app.query("#gpu-row-1")) == 1


def painted(app: Bars) -> list[str]:
    """The screen as the compositor last drew it, one string a line."""
    return ["".join(seg.text for seg in strip).rstrip() for strip in app.screen._compositor.render_strips()]


async def test_a_new_row_is_shown_only_once_its_line_is_mounted() -> None:
    """Seen on an H200 (the dashboard's first screen, and by capturing a CPU dashboard every 0.1 s): a row mounted
    in one frame is composed in a later one, and the frame between painted the GPUs pane as one blank line."""
    app = Bars()
    async with app.run_test(size=(120, 12)) as pilot:
        bars = app.query_one(GpuBars)
        bars.update_sample(sample(1, 0))
        row = app.query_one("#gpu-row-0", GpuRow)
        assert not row.children  # mounted, not composed yet
        assert not row.display  # so no blank line for it
        placeholder = app.query_one("#gpu-empty", Static)
        assert placeholder.display  # the placeholder keeps the pane's line meanwhile, saying what is happening
        assert "reading the GPU sample" in str(placeholder.render())
        await pilot.pause()
        assert row.children and row.display
        assert not app.query_one("#gpu-empty").display
        lines = painted(app)
        assert lines[1].startswith("│ 0 H200") and " 10%" in lines[1], lines[:3]
        bars.update_sample(sample(2))  # the GPU gone from a sample: its row hidden, the placeholder says why
        await pilot.pause()
        assert not row.display and "no GPUs in the latest sample" in painted(app)[1]
        bars.update_sample(sample(3, 0))
        await pilot.pause()
        assert row.display and painted(app)[1].startswith("│ 0 H200")
