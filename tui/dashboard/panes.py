"""Every pane of the dashboard, declared once: the ``Dirty`` key that redraws it, its widget made from the part of
the state it renders, its CSS id and title, and how it redraws from the state.

Both screens compose and draw their panes from these declarations; where each sits, and the order they are drawn
in, is the screen's own (``PANES`` of ``screens/dashboard.py``, ``NODE_PANES`` of ``screens/nodes.py``).
``DashboardScreen`` shows one of each; ``NodesScreen`` shows its ``NODE_PANES`` once per node (ids ``gpus-0``,
``charts-0``, ..., titled ``GPUs · node 0 · gpu-a``) and ``LOG`` over the merged log. The key footers and the
nodes screen's header lines are the screens' own, not panes of the state.
"""

from __future__ import annotations

from collections.abc import Callable, Set
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from textual.dom import DOMNode
from textual.widget import Widget

from tui.dashboard.state import DashboardState, Dirty
from tui.dashboard.widgets.charts import Charts
from tui.dashboard.widgets.gpu_bars import GpuBars
from tui.dashboard.widgets.header import RunHeader
from tui.dashboard.widgets.log_tail import LogModel, LogPane
from tui.dashboard.widgets.proc_tree import ProcTree
from tui.dashboard.widgets.run_timeline import RunTimeline

S = TypeVar("S", contravariant=True)  # a pane that draws from a LogSource draws from any state with a log
W = TypeVar("W", bound=Widget)


def _unchanged(state: object) -> bool:
    return False


@dataclass(frozen=True)
class Pane(Generic[S, W]):
    """One pane: drawn again when ``key`` is in the state's ``dirty`` (or ``changed`` says its model moved)."""

    key: str  # a Dirty key
    id: str  # its CSS id; ``{id}-{i}`` for node i on the nodes screen
    title: str  # its border title; the nodes screen adds the node's number and label
    widget: type[W]
    make: Callable[[S, str], W]  # (the state, the id) -> the widget, holding the model it renders
    draw: Callable[[W, S], object]  # the widget drawn again from the state
    throttled: bool = False  # drawn only while the screen allows it (charts, a few times a second); else kept dirty
    changed: Callable[[S], bool] = _unchanged  # its model moved without the key being set

    def node_id(self, node: int | None = None) -> str:
        return self.id if node is None else f"{self.id}-{node}"

    def compose(self, state: S, node: int | None = None) -> W:
        return self.make(state, self.node_id(node))

    def redraw(self, screen: DOMNode, state: S, dirty: Set[str], allowed: bool, node: int | None = None) -> bool:
        """Draw the pane if it is due; True when it is due but held back (throttled while not ``allowed``)."""
        if self.key not in dirty and not self.changed(state):
            return False
        if self.throttled and not allowed:
            return True
        self.draw(screen.query_one(f"#{self.node_id(node)}", self.widget), state)
        return False


class LogSource(Protocol):
    """A state with a log: one node's (``DashboardState``) or every node's, tagged (``NodesState``)."""

    @property
    def log(self) -> LogModel: ...


def _draw_gpus(bars: GpuBars, state: DashboardState) -> None:
    if state.gpus is not None:
        bars.update_sample(state.gpus)
    bars.update_anomalies(state.anomalies)


HEADER: Pane[DashboardState, RunHeader] = Pane(
    Dirty.HEADER, "header", "", RunHeader, lambda s, id: RunHeader(s.header, id=id), lambda w, s: w.refresh()
)
TIMELINE: Pane[DashboardState, RunTimeline] = Pane(
    Dirty.TIMELINE, "timeline", "", RunTimeline, lambda s, id: RunTimeline(s.timeline, id=id), lambda w, s: w.refresh()
)
GPUS: Pane[DashboardState, GpuBars] = Pane(
    Dirty.GPUS, "gpus", "GPUs", GpuBars, lambda s, id: GpuBars(id=id), _draw_gpus
)
CHARTS: Pane[DashboardState, Charts] = Pane(
    Dirty.CHARTS,
    "charts",
    "training",
    Charts,
    lambda s, id: Charts(s.charts, id=id),
    lambda w, s: w.redraw(),
    throttled=True,
    changed=lambda s: s.charts.dirty,
)
PROCS: Pane[DashboardState, ProcTree] = Pane(
    Dirty.PROCS,
    "procs",
    "processes",
    ProcTree,
    lambda s, id: ProcTree(s.health, s.clock, id=id),
    lambda w, s: w.update_procs(s.procs),
)
LOG: Pane[LogSource, LogPane] = Pane(
    Dirty.LOG, "log", "log", LogPane, lambda s, id: LogPane(s.log, id=id), lambda w, s: w.flush()
)
