"""The dashboard: what the agent's events say about the host and the run, and the screen that shows it.

``DashboardState.ingest`` takes every event as it arrives (cheap: bounded models, latest-wins for
samples); ``DashboardScreen.apply`` draws what changed, called by the app on its flush interval
inside ``batch_update()``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from textual import events
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.reactive import Reactive
from textual.screen import Screen
from textual.widget import Widget

from tui import restarts
from tui.widgets.charts import ChartModel, Charts
from tui.widgets.footer import KeyFooter
from tui.widgets.gpu_bars import GpuBars
from tui.widgets.header import HeaderModel, RunHeader
from tui.widgets.log_tail import LogModel, LogPane
from tui.widgets.proc_tree import ProcTree, ThreadHealthModel
from tui.widgets.run_timeline import RunTimeline, TimelineModel

MAX_NOTICES = 50
MAX_PARSED_LINES_PER_EVENT = 20
NARROW_WIDTH = 110  # columns below which the process tree goes under the GPUs
_METRIC_HINTS = ("step", "tok/s", "loss")


class DashboardState:
    """Everything the dashboard knows, fed one agent event at a time."""

    def __init__(self, target: str, max_log_lines: int = 20_000, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.header = HeaderModel(target=target)
        self.log = LogModel(max_log_lines)
        self.charts = ChartModel()
        self.health = ThreadHealthModel()
        self.timeline = TimelineModel()
        self.run: dict[str, Any] | None = None
        self.gpus: dict[str, Any] | None = None
        self.procs: dict[str, Any] | None = None
        self.anomalies: list[dict[str, Any]] = []
        self.notices: deque[tuple[str, str]] = deque(maxlen=MAX_NOTICES)  # (severity, message) to show
        self.events_in = 0
        self.dirty: set[str] = set()
        self.engine_steps_seen = False
        self.new_log_lines = 0
        self.pending_messages: list[dict[str, Any]] = []  # run / milestone events to post as messages

    def ingest(self, ev: dict[str, Any]) -> None:
        self.events_in += 1
        kind = ev.get("ev")
        if kind == "log":
            offset = ev.get("offset")
            data = ev.get("data")
            if isinstance(offset, int) and isinstance(data, str):
                n = self.log.feed(offset, ev.get("inode") if isinstance(ev.get("inode"), int) else None, data)
                if n:
                    self.new_log_lines += n
                    self.dirty.add("log")
                    if not self.engine_steps_seen:
                        self._parse_log_metrics(n)
        elif kind == "log_reset":
            offset = ev.get("offset")
            inode = ev.get("inode")
            self.log.reset(
                inode if isinstance(inode, int) else None,
                offset if isinstance(offset, int) else 0,
                str(ev.get("reason", "reset")),
            )
            self.dirty.add("log")
        elif kind == "engine":
            event = ev.get("event")
            offset = ev.get("offset")
            if isinstance(event, dict) and ev.get("source"):
                # Another rank's events file: its threads' health only (the charts show the run's events.jsonl).
                self.health.add_engine_event(event, main_file=False)
                self.dirty.add("procs")
            elif isinstance(event, dict) and self.charts.add_engine_event(
                offset if isinstance(offset, int) else None, event
            ):
                self._engine_event(event)
        elif kind == "gpus":
            self.gpus = ev
            self.header.simulated = bool(ev.get("simulated"))
            self.dirty.add("gpus")
        elif kind == "procs":
            self.procs = ev
            self.dirty.add("procs")
        elif kind == "anomalies":
            items = ev.get("items")
            self.anomalies = [a for a in items if isinstance(a, dict)] if isinstance(items, list) else []
            for anomaly in self.anomalies:
                if anomaly.get("kind") == "dead_thread" and isinstance(anomaly.get("thread"), str):
                    self.health.mark_dead(anomaly["thread"], str(anomaly.get("message", "")))
            self.dirty.update({"gpus", "procs"})
        elif kind == "run":
            run = ev.get("run")
            self._set_run(run if isinstance(run, dict) else None)
            self.pending_messages.append(ev)
        elif kind == "milestone":
            self.timeline.from_milestone(ev)
            if isinstance(ev.get("run_id"), str):
                self.header.run_id = ev["run_id"]
            if not ev.get("ok") and ev.get("cause"):
                self.notices.append(("error", f"launch failed at {ev.get('milestone')}: {ev.get('cause')}"))
            self.pending_messages.append(ev)
            self.dirty.update({"timeline", "header"})
        elif kind == "connection":
            self.header.state = str(ev.get("state", self.header.state))
            detail = ev.get("detail")
            self.header.detail = detail if isinstance(detail, str) else None
            attempt = ev.get("attempt")
            self.header.attempt = attempt if isinstance(attempt, int) else None
            self.dirty.add("header")
        elif kind == "hello":
            host = ev.get("hostname")
            self.header.hostname = host if isinstance(host, str) else None
            self.header.simulated = bool(ev.get("simulated"))
            self.dirty.add("header")
        elif kind in ("warning", "error"):
            self.notices.append(("warning" if kind == "warning" else "error", str(ev.get("message", ""))))

    def ingest_status(self, status: dict[str, Any]) -> None:
        """A ``status`` reply (after an attach, or at start) as the events it summarises."""
        gpus = status.get("gpus")
        if isinstance(gpus, list):
            simulated = any(isinstance(g, dict) and g.get("simulated") for g in gpus)
            self.ingest({"ev": "gpus", "gpus": gpus, "simulated": simulated, "t": self.clock()})
        if "run" in status:
            self.ingest({"ev": "run", "run": status.get("run")})
        if isinstance(status.get("anomalies"), list):
            self.ingest({"ev": "anomalies", "items": status["anomalies"]})

    def _set_run(self, run: dict[str, Any] | None) -> None:
        old_id = self.run.get("run_id") if self.run else None
        new_id = run.get("run_id") if run else None
        if new_id != old_id and old_id is not None:
            # A new run: its events.jsonl starts again at byte 0 and its threads are new.
            self.charts.clear()
            self.health.clear()
            self.engine_steps_seen = False
        before = len(restarts.restarts_of(self.run)) if new_id == old_id else 0
        self.run = run
        self.timeline.from_run(run)
        self.header.run_id = new_id if isinstance(new_id, str) else None
        self.header.run_state = str(run.get("state")) if run else None
        self.header.restarts = restarts.summary(run)
        done = restarts.restarts_of(run)
        self.header.restarted = bool(done)
        if len(done) > before:
            self.health.clear()  # restarted: the threads (and their deaths) of the attempt before are gone
        max_restarts = run.get("restart_max") if run else None
        for i, item in enumerate(done[before:], start=before + 1):
            self.notices.append(("warning", f"run {new_id}: {restarts.line(i, item, max_restarts)}"))
        failed = run is not None and run.get("state") == "failed"
        rank, node = (run.get("failed_rank"), run.get("failed_node")) if failed and run else (None, None)
        where = f"rank {rank}" + (f" (node {node})" if isinstance(node, int) else "") if isinstance(rank, int) else None
        self.header.failed_rank = where
        self.dirty.update({"header", "timeline", "charts", "procs"})

    def _engine_event(self, event: dict[str, Any]) -> None:
        kind = event.get("kind")
        self.health.add_engine_event(event)
        if kind == "step":
            self.engine_steps_seen = True
            self.dirty.add("charts")
        elif kind == "eval":
            self.dirty.add("charts")
            if event.get("error"):
                self.notices.append(("warning", f"evaluation of {event.get('thread')} failed: {event.get('error')}"))
        elif kind == "stage":
            stage = event.get("stage")
            if isinstance(stage, str):
                self.timeline.stage = stage
                self.dirty.add("timeline")
        elif kind == "export":
            path = event.get("path")
            if isinstance(path, str):
                self.timeline.last_export = path
                self.notices.append(("information", f"drafter exported to {path} ({event.get('format')})"))
                self.dirty.add("timeline")
        elif kind == "thread_error":
            self.notices.append(
                ("error", f"thread {event.get('thread')} died: {event.get('exc_type')}: {event.get('message')}")
            )
        elif kind == "run_end":
            ok = bool(event.get("ok"))
            self.notices.append(
                (
                    "information" if ok else "error",
                    f"engine finished ({'ok' if ok else 'failed'}): {event.get('reason')}",
                )
            )
        self.dirty.add("procs")

    def _parse_log_metrics(self, n: int) -> None:
        now = self.clock()
        # A sample of the newest lines is enough for a chart; parsing every line of a burst is not.
        newest = list(itertools.islice(reversed(self.log.lines), min(n, MAX_PARSED_LINES_PER_EVENT)))
        for line in reversed(newest):
            if any(h in line for h in _METRIC_HINTS) and self.charts.add_log_line(line, now):
                self.dirty.add("charts")


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

    @property
    def log_pane(self) -> LogPane:
        return self.query_one(LogPane)

    def apply(self, *, charts_allowed: bool) -> None:
        """Draw what changed since the last call."""
        state = self.state
        dirty = state.dirty
        if "header" in dirty:
            self.query_one(RunHeader).refresh()
        if "timeline" in dirty:
            self.query_one(RunTimeline).refresh()
        if "gpus" in dirty:
            bars = self.query_one(GpuBars)
            if state.gpus is not None:
                bars.update_sample(state.gpus)
            bars.update_anomalies(state.anomalies)
        if "procs" in dirty:
            tree = self.query_one(ProcTree)
            tree.update_procs(state.procs or {})
        if "log" in dirty:
            self.log_pane.flush()
        keep: set[str] = set()
        if "charts" in dirty or state.charts.dirty:
            if charts_allowed:
                self.query_one(Charts).redraw()
            else:
                keep.add("charts")
        dirty.clear()
        dirty.update(keep)
