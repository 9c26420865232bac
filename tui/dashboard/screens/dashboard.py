"""The dashboard screen: header and timeline on top, GPUs and charts left, processes right, the log below.

Its panes are declared in ``tui/dashboard/panes.py`` and fed by ``DashboardState`` (``tui/dashboard/state.py``);
``DashboardScreen.apply`` draws the panes whose ``Dirty`` keys changed, called by the app on its flush interval
inside ``batch_update()``.
"""

from __future__ import annotations

from typing import Any

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import Reactive
from textual.screen import Screen
from textual.widget import Widget

from engine import protocol
from tui.dashboard import panes
from tui.dashboard.panes import Pane
from tui.dashboard.state import DashboardState, Dirty
from tui.dashboard.widgets.footer import KeyFooter
from tui.dashboard.widgets.log_tail import LogPane
from tui.hosttext import printable

NARROW_WIDTH = 80  # columns below which the process tree goes under the GPUs (80x24 keeps it beside them)
SHORT_HEIGHT = 30  # rows below which the training pane is kept shorter, so the log keeps its rows
# The order the panes are drawn in on a flush.
PANES: tuple[Pane[DashboardState, Any], ...] = (
    panes.HEADER,
    panes.TIMELINE,
    panes.GPUS,
    panes.PROCS,
    panes.LOG,
    panes.CHARTS,
)


def training_title(run: protocol.RunInfo | None, width: int) -> str:
    """The training pane's title: the engine's output directory (what `specdec-train export` takes), its end kept
    when the path is longer than about half the screen's width."""
    if run is None or not run.output_dir:
        return panes.CHARTS.title
    path = printable(run.output_dir)
    room = max(12, width // 2 - 16)
    return f"{panes.CHARTS.title} · output {path if len(path) <= room else '…' + path[-(room - 1) :]}"


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
        yield panes.HEADER.compose(state)
        yield panes.TIMELINE.compose(state)
        with Horizontal(id="upper"):
            with Vertical(id="left"):
                yield panes.GPUS.compose(state)
                with Vertical(id="charts-box"):  # the charts scroll inside it, under its title
                    yield panes.CHARTS.compose(state)
            yield panes.PROCS.compose(state)
        yield panes.LOG.compose(state)
        yield KeyFooter(self.keymap, id="footer")

    def on_mount(self) -> None:
        self.query_one("#charts-box").border_title = panes.CHARTS.title
        self.ready = True

    def on_resize(self, event: events.Resize) -> None:
        self.set_class(event.size.width < NARROW_WIDTH, "-narrow")
        self.set_class(event.size.height < SHORT_HEIGHT, "-short")

    @property
    def log_pane(self) -> LogPane:
        return self.query_one(LogPane)

    def apply(self, *, charts_allowed: bool) -> None:
        """Draw what changed since the last call; charts only when ``charts_allowed``, else they stay dirty."""
        state = self.state
        dirty = state.dirty
        if Dirty.TIMELINE in dirty:
            self.query_one("#charts-box").border_title = training_title(state.run, self.size.width)
        if Dirty.LOG in dirty and state.follow_log:
            state.follow_log = False
            self.log_pane.tail.action_follow()
        keep = {pane.key for pane in PANES if pane.redraw(self, state, dirty, charts_allowed)}
        dirty.clear()
        dirty.update(keep)
