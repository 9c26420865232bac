"""The dashboard screen: header and timeline on top, GPUs and charts left, processes right, the log below.

It draws ``DashboardState`` (``tui/dashboard/state.py``): ``DashboardScreen.apply`` draws the panes whose ``Dirty``
keys changed, called by the app on its flush interval inside ``batch_update()``.
"""

from __future__ import annotations

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import Reactive
from textual.screen import Screen
from textual.widget import Widget

from engine import protocol
from tui.dashboard.state import DashboardState, Dirty
from tui.dashboard.widgets.charts import Charts
from tui.dashboard.widgets.footer import KeyFooter
from tui.dashboard.widgets.gpu_bars import GpuBars
from tui.dashboard.widgets.header import RunHeader
from tui.dashboard.widgets.log_tail import LogPane
from tui.dashboard.widgets.proc_tree import ProcTree
from tui.dashboard.widgets.run_timeline import RunTimeline
from tui.hosttext import printable

NARROW_WIDTH = 80  # columns below which the process tree goes under the GPUs (80x24 keeps it beside them)
SHORT_HEIGHT = 30  # rows below which the training pane is kept shorter, so the log keeps its rows


def training_title(run: protocol.RunInfo | None, width: int) -> str:
    """The training pane's title: the engine's output directory (what `specdec-train export` takes), its end kept
    when the path is longer than about half the screen's width."""
    if run is None or not run.output_dir:
        return "training"
    path = printable(run.output_dir)
    room = max(12, width // 2 - 16)
    return f"training · output {path if len(path) <= room else '…' + path[-(room - 1) :]}"


class DashboardScreen(Screen[None]):
    """Header and timeline on top, GPUs and charts left, processes right, the log below."""

    # Textual's Screen repaints every cell when focus moves (``focused`` repaints by default): `/` into the
    # filter box and Esc out of it were full-screen frames (27 KB, ~30 ms). The widgets that gain and lose
    # focus restyle and redraw themselves (``:focus`` / ``:focus-within``), so only their regions change.
    focused: Reactive[Widget | None] = Reactive(None, repaint=False)

    def __init__(self, state: DashboardState, keymap: dict[str, str] | None = None) -> None:
        super().__init__(id="dashboard")
        self.state = state
        self.keymap = keymap or {}
        self.ready = False  # set once the panes are mounted; flushes before that are kept for later

    def compose(self) -> ComposeResult:
        state = self.state
        yield RunHeader(state.header, id="header")
        yield RunTimeline(state.timeline, id="timeline")
        with Horizontal(id="upper"):
            with Vertical(id="left"):
                yield GpuBars(id="gpus")
                with Vertical(id="charts-box"):
                    yield Charts(state.charts, id="charts")
            yield ProcTree(state.health, state.clock, id="procs")
        yield LogPane(state.log, id="log")
        yield KeyFooter(self.keymap, id="footer")

    def on_mount(self) -> None:
        self.query_one("#charts-box").border_title = "training"
        self.ready = True

    def on_resize(self, event: events.Resize) -> None:
        self.set_class(event.size.width < NARROW_WIDTH, "-narrow")
        self.set_class(event.size.height < SHORT_HEIGHT, "-short")

    @property
    def log_pane(self) -> LogPane:
        return self.query_one(LogPane)

    def apply(self, *, charts_allowed: bool) -> None:
        """Draw what changed since the last call."""
        state = self.state
        dirty = state.dirty
        if Dirty.HEADER in dirty:
            self.query_one(RunHeader).refresh()
        if Dirty.TIMELINE in dirty:
            self.query_one(RunTimeline).refresh()
            self.query_one("#charts-box").border_title = training_title(state.run, self.size.width)
        if Dirty.GPUS in dirty:
            bars = self.query_one(GpuBars)
            if state.gpus is not None:
                bars.update_sample(state.gpus)
            bars.update_anomalies(state.anomalies)
        if Dirty.PROCS in dirty:
            tree = self.query_one(ProcTree)
            tree.update_procs(state.procs)
        if Dirty.LOG in dirty:
            if state.follow_log:
                state.follow_log = False
                self.log_pane.tail.action_follow()
            self.log_pane.flush()
        keep: set[str] = set()
        if Dirty.CHARTS in dirty or state.charts.dirty:
            if charts_allowed:
                self.query_one(Charts).redraw()
            else:
                keep.add(Dirty.CHARTS)
        dirty.clear()
        dirty.update(keep)
