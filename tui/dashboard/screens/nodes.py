"""One screen for a run across several nodes: each node's GPUs, training charts (its ranks' series) and processes
grouped under its label, one log
of every node's lines tagged ``[node]`` / ``[node/rank R]``, and a failure anywhere named at the top.

Each node keeps its own ``DashboardState`` (the one-node dashboard's models, fed that node's events only, so a
node's log offsets, thread health and run stay its own). ``NodesState.ingest`` hands a node's event to its state
and moves the log lines it produced, tagged, into the merged log; ``NodesScreen.apply`` draws what changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.markup import escape
from textual.screen import Screen

from engine import protocol
from tui.dashboard import panes
from tui.dashboard.panes import Pane
from tui.dashboard.state import DashboardState, Dirty
from tui.dashboard.widgets.log_tail import LogModel, LogPane
from tui.dashboard.widgets.text_line import TextLine
from tui.hosttext import printable
from tui.link.events import ClientEvent, ConnectionEvent
from tui.nodes import NodeRun, combined_run, tag_line

# What the screen shows of each node, in the order it draws them.
NODE_PANES: tuple[Pane[DashboardState, Any], ...] = (panes.GPUS, panes.CHARTS, panes.PROCS)
LINK_UP = "connected"
LINK_DOWN = ("reconnecting", "failed", "disconnected")  # a node's link in these counts as unreachable
NODES_KEYS = (
    " l Launch  r Restart  s Stop (every node)  a Attach  k Kill stale  d Stacks (a node)  / Filter  f Follow"
    "  t Theme  q Quit"
)


class NodesState:
    """Every node's dashboard state, by label in node order, and the merged, tagged log."""

    def __init__(self, labels: list[str], max_log_lines: int = 20_000, clock: Callable[[], float] = time.time) -> None:
        self.labels = list(labels)
        self.clock = clock
        self.readonly = False  # watching only: said first on the run's line
        self.nodes = {label: DashboardState(label, max_log_lines=max_log_lines, clock=clock) for label in labels}
        self.log = LogModel(max_log_lines)
        self.dirty: set[str] = set()  # the screen's own: Dirty.HEADER (its lines) and Dirty.LOG (the merged log)
        self.node_dirty: dict[str, set[str]] = {label: set() for label in labels}  # each node's panes to draw
        self.failure_seen_at: float | None = None  # when the top line first named a failure (monotonic)

    def ingest(self, label: str, ev: ClientEvent) -> None:
        node = self.nodes[label]
        node.ingest(ev)
        if Dirty.LOG in node.dirty:
            lines = node.log.take_unflushed()
            if lines:
                self.log.add_lines([tag_line(label, line) for line in lines])
                self.dirty.add(Dirty.LOG)
        if Dirty.HEADER in node.dirty or isinstance(ev, (protocol.RunEvent, ConnectionEvent, protocol.MilestoneEvent)):
            self.dirty.add(Dirty.HEADER)
        self.node_dirty[label].update(node.dirty - {Dirty.LOG, Dirty.HEADER})
        node.dirty.clear()

    def changed(self) -> bool:
        """Whether anything is left to draw: the screen's own lines or log, or a node's panes."""
        return bool(self.dirty) or any(self.node_dirty.values())

    def parts(self) -> list[NodeRun]:
        """Each node's run for the combined state; a node whose link is not up counts as unreachable."""
        out = []
        for label in self.labels:
            header = self.nodes[label].header
            down = f"link {header.state}" if header.state in LINK_DOWN else None
            if down and header.detail:
                down += f": {header.detail}"
            out.append(NodeRun(label, self.nodes[label].run, down))
        return out

    def rank_nodes(self) -> dict[int, str]:
        """Global rank -> the node whose events file it writes (each node's own ranks only)."""
        return {rank: label for label in self.labels for rank in self.nodes[label].health.ranks()}

    def milestones(self) -> list[tuple[str, int]]:
        """Each launch milestone and on how many nodes the current runs reached it (the timeline over all nodes)."""
        runs = [self.nodes[label].run for label in self.labels]
        return [(m, sum(1 for r in runs if r is not None and r.milestones.get(m))) for m in protocol.MILESTONES]

    def combined(self) -> dict[str, object]:
        return combined_run(self.parts(), self.rank_nodes())


class NodesScreen(Screen[None]):
    """The run's line and each node's link on top, per node GPUs beside processes, the merged log below."""

    DEFAULT_CSS = """
    NodesScreen { layout: vertical; }
    NodesScreen > #nodes-header { height: auto; background: $panel; }
    NodesScreen > #nodes-header > TextLine.-failed { color: $error; text-style: bold; }
    NodesScreen > #nodes-upper { height: auto; max-height: 60%; }
    NodesScreen .node-row { height: auto; }
    NodesScreen .node-row > .node-left { width: 3fr; height: auto; }
    NodesScreen .node-left > Charts { max-height: 10; border: round $panel-lighten-2; border-title-color: $text-muted; }
    NodesScreen .node-row > ProcTree { width: 2fr; height: auto; }
    NodesScreen > #log { height: 1fr; min-height: 6; }
    """

    def __init__(self, state: NodesState) -> None:
        super().__init__(id="nodes")
        self.state = state
        self.ready = False

    def compose(self) -> ComposeResult:
        with Vertical(id="nodes-header"):
            yield TextLine("", id="run-line")
            yield TextLine("", id="failure-line")
            for i, _label in enumerate(self.state.labels):
                yield TextLine("", id=f"link-{i}", classes="link-line")
        with VerticalScroll(id="nodes-upper"):
            for i, label in enumerate(self.state.labels):
                node = self.state.nodes[label]
                with Horizontal(classes="node-row", id=f"node-{i}"):
                    with Vertical(classes="node-left"):
                        yield panes.GPUS.compose(node, i)
                        yield panes.CHARTS.compose(node, i)
                    yield panes.PROCS.compose(node, i)
        yield panes.LOG.compose(self.state)
        yield TextLine(NODES_KEYS, id="footer")

    def on_mount(self) -> None:
        for i, label in enumerate(self.state.labels):
            name = escape(printable(label))  # a border title is markup: a label's brackets stay text
            for pane in NODE_PANES:
                self.query_one(f"#{pane.node_id(i)}").border_title = f"{pane.title} · node {i} · {name}"
        self.query_one(LogPane).border_title = escape("log · every node, tagged [node] or [node/rank R] (/ filters)")
        self.ready = True
        self.state.dirty.add(Dirty.HEADER)
        self.apply()

    @property
    def log_pane(self) -> LogPane:
        return self.query_one(LogPane)

    def apply(self, *, charts_allowed: bool = True) -> None:
        """Draw what changed; charts only when ``charts_allowed`` (they redraw a few times a second at most)."""
        state = self.state
        dirty = set(state.dirty)
        state.dirty.clear()
        if Dirty.HEADER in dirty:
            self._draw_header()
        for i, label in enumerate(state.labels):
            node, node_dirty = state.nodes[label], state.node_dirty[label]
            keep = {pane.key for pane in NODE_PANES if pane.redraw(self, node, node_dirty, charts_allowed, i)}
            node_dirty.clear()
            node_dirty.update(keep)
        panes.LOG.redraw(self, state, dirty, charts_allowed)

    def _draw_header(self) -> None:
        state = self.state
        combined = state.combined()
        run_id = combined.get("run_id") or "-"
        text = Text(
            printable(
                f" specdec{' · READ-ONLY' if state.readonly else ''} · {len(state.labels)} nodes · run {run_id} "
                f"{combined['state']} · {combined['running']}/{len(state.labels)} running"
            )
        )
        reached = [
            f"{m} {'✓' if n == len(state.labels) else f'{n}/{len(state.labels)}'}" for m, n in state.milestones() if n
        ]
        if reached:
            text.append(printable("   " + " → ".join(reached)))
        self.query_one("#run-line", TextLine).set_text(text)
        failure = self.query_one("#failure-line", TextLine)
        if combined["state"] in ("failed", "unreachable"):
            rank = combined.get("failed_rank")
            where = f" rank {rank}" if rank is not None else ""
            word = "FAILED" if combined["state"] == "failed" else "UNREACHABLE"
            failure.set_text(Text(printable(f" {word}{where}: {combined['cause']}")))
            failure.add_class("-failed")
            if state.failure_seen_at is None:
                state.failure_seen_at = time.monotonic()
        else:
            failure.set_text(Text(""))
            failure.remove_class("-failed")
        for i, label in enumerate(state.labels):
            node = state.nodes[label]
            header, run = node.header, node.run
            bits = [f" ● node {i} {label}", header.state or "not connected"]
            if header.rtt_ms is not None and header.state == LINK_UP:
                bits[-1] += f" {header.rtt_ms:.0f} ms"
            elif header.detail and header.state != LINK_UP:
                bits[-1] += f" ({header.detail})"
            if run is not None:
                step = f" step {run.last_step}" if run.last_step is not None else ""
                bits.append(f"run {run.run_id} {run.state}{step}")
                if run.state == "failed" and run.cause:
                    bits.append(run.cause)
            self.query_one(f"#link-{i}", TextLine).set_text(Text(printable("  ".join(bits))))
