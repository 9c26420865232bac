"""What the dashboard knows of the host and the run, fed one decoded event at a time.

``DashboardState.ingest`` takes every event as it arrives (cheap: bounded models, latest-wins for samples) and
marks in ``dirty`` which parts changed, by the keys of ``Dirty``; the screens draw the panes those keys name
(``tui/dashboard/panes.py``) on their next flush.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Final

from engine import protocol
from tui import restarts
from tui.dashboard.widgets.charts import ChartModel
from tui.dashboard.widgets.header import HeaderModel
from tui.dashboard.widgets.log_tail import LogModel
from tui.dashboard.widgets.proc_tree import ThreadHealthModel
from tui.dashboard.widgets.run_timeline import TimelineModel
from tui.link.events import ClientEvent, ConnectionEvent, Undecodable

MAX_NOTICES = 50
MAX_PARSED_LINES_PER_EVENT = 20
_METRIC_HINTS = ("step", "tok/s", "loss")


class Dirty:
    """The parts of the state that can change between two draws; each names the pane (``panes.py``) it redraws."""

    HEADER: Final = "header"
    TIMELINE: Final = "timeline"
    GPUS: Final = "gpus"
    CHARTS: Final = "charts"
    PROCS: Final = "procs"
    LOG: Final = "log"


class DashboardState:
    """Everything the dashboard knows, fed one decoded event at a time."""

    def __init__(self, target: str, max_log_lines: int = 20_000, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.header = HeaderModel(target=target)
        self.log = LogModel(max_log_lines)
        self.charts = ChartModel()
        self.health = ThreadHealthModel()
        self.timeline = TimelineModel()
        self.run: protocol.RunInfo | None = None
        self.gpus: protocol.GpusEvent | None = None
        self.procs: protocol.ProcsEvent | None = None
        self.anomalies: list[protocol.Anomaly] = []
        self.notices: deque[tuple[str, str]] = deque(maxlen=MAX_NOTICES)  # (severity, message) to show
        self.events_in = 0
        self.undecodable: dict[str | None, int] = {}  # agent events not understood, by their ``ev``
        self.dirty: set[str] = set()
        # A new run, a restart or a new log file: the log pane follows its end again, however it was scrolled.
        self.follow_log = False
        # Runs this dashboard moved on from: engine lines of theirs still in flight are not the new run's (a
        # relaunch's charts and thread health would otherwise show the old run's last steps and heartbeats).
        self.left_runs: set[str] = set()
        self.engine_steps_seen = False
        # The host's clock when this dashboard's agent said hello: engine events from before it (a finished run's
        # "engine finished", its last export) are history, drawn but not announced again as notices.
        self.opened_at_host: float | None = None

    def ingest(self, ev: ClientEvent) -> None:
        self.events_in += 1
        if isinstance(ev, protocol.LogEvent):
            n = self.log.feed(ev.offset, ev.inode, ev.data)
            if n:
                self.dirty.add(Dirty.LOG)
                if not self.engine_steps_seen:
                    self._parse_log_metrics(n)
        elif isinstance(ev, protocol.LogResetEvent):
            self.log.reset(ev.inode, ev.offset, ev.reason)
            self.follow_log = True
            self.dirty.add(Dirty.LOG)
        elif isinstance(ev, protocol.EngineLineEvent):
            if ev.run_id is not None and ev.run_id in self.left_runs:
                return
            if ev.source:
                # Another rank's events file: its threads' health only (the charts show the run's events.jsonl).
                self.health.add_engine_event(ev.event, main_file=False)
                self.dirty.add(Dirty.PROCS)
            elif self.charts.add_engine_event(ev.offset, ev.event):
                self._engine_event(ev.event)
        elif isinstance(ev, protocol.GpusEvent):
            self.gpus = ev
            self.header.simulated = ev.simulated
            self.dirty.add(Dirty.GPUS)
        elif isinstance(ev, protocol.ProcsEvent):
            self.procs = ev
            self.dirty.add(Dirty.PROCS)
        elif isinstance(ev, protocol.AnomaliesEvent):
            self.anomalies = ev.items
            for anomaly in self.anomalies:
                if anomaly.kind == "dead_thread" and anomaly.thread:
                    self.health.mark_dead(anomaly.thread, anomaly.message)
            self.dirty.update({Dirty.GPUS, Dirty.PROCS})
        elif isinstance(ev, protocol.RunEvent):
            self._set_run(ev.run)
        elif isinstance(ev, protocol.MilestoneEvent):
            self.timeline.from_milestone(ev)
            if ev.run_id is not None:
                self.header.run_id = ev.run_id
            if not ev.ok and ev.cause:
                self.notices.append(("error", f"launch failed at {ev.milestone}: {ev.cause}"))
            self.dirty.update({Dirty.TIMELINE, Dirty.HEADER})
        elif isinstance(ev, ConnectionEvent):
            self.header.state = ev.state
            self.header.detail = ev.detail or None
            self.header.attempt = ev.attempt
            self.dirty.add(Dirty.HEADER)
        elif isinstance(ev, protocol.HelloEvent):
            if self.opened_at_host is None:
                self.opened_at_host = ev.t
            self.header.hostname = ev.hostname
            self.header.simulated = ev.simulated
            self.dirty.add(Dirty.HEADER)
        elif isinstance(ev, (protocol.WarningEvent, protocol.ErrorEvent)):
            self.notices.append(("warning" if isinstance(ev, protocol.WarningEvent) else "error", ev.message))
        elif isinstance(ev, Undecodable):
            seen = self.undecodable[ev.ev] = self.undecodable.get(ev.ev, 0) + 1
            self.header.undecodable = sum(self.undecodable.values())
            self.dirty.add(Dirty.HEADER)
            if seen == 1:  # the first of its kind in words; the header counts them all
                self.notices.append(("error", ev.message))

    def ingest_status(self, status: protocol.StatusReply) -> None:
        """A ``status`` reply (after an attach, or at start) as the events it summarises."""
        simulated = any(g.simulated for g in status.gpus)
        self.ingest(protocol.GpusEvent(self.clock(), status.gpus, simulated))
        self.ingest(protocol.RunEvent(status.run))
        self.ingest(protocol.AnomaliesEvent(status.anomalies))

    def _set_run(self, run: protocol.RunInfo | None) -> None:
        old_id = self.run.run_id if self.run else None
        new_id = run.run_id if run else None
        if new_id != old_id and old_id is not None:
            # A new run: its events.jsonl starts again at byte 0 and its threads are new.
            self.charts.clear()
            self.health.clear()
            self.engine_steps_seen = False
            self.follow_log = True
            self.left_runs.add(old_id)
        if new_id is not None:
            self.left_runs.discard(new_id)
        before = len(restarts.restarts_of(self.run)) if new_id == old_id else 0
        self.run = run
        self.health.run_over = run is not None and run.state not in ("starting", "running")
        self.dirty.add(Dirty.PROCS)
        self.timeline.from_run(run)
        self.header.run_id = new_id
        self.header.run_state = run.state if run else None
        self.header.restarts = restarts.summary(run)
        done = restarts.restarts_of(run)
        self.header.restarted = bool(done)
        if len(done) > before:
            self.health.clear()  # restarted: the threads (and their deaths) of the attempt before are gone
            self.follow_log = True
        max_restarts = run.restart_max if run else None
        if old_id is None and self.opened_at_host is not None:
            before = len(done)  # the first look at a run: its restarts so far are history (the header counts them)
        for i, item in enumerate(done[before:], start=before + 1):
            self.notices.append(("warning", f"run {new_id}: {restarts.line(i, item, max_restarts)}"))
        failed = run is not None and run.state == "failed"
        rank, node = (run.failed_rank, run.failed_node) if failed and run else (None, None)
        where = f"rank {rank}" + (f" (node {node})" if node is not None else "") if rank is not None else None
        self.header.failed_rank = where
        self.dirty.update({Dirty.HEADER, Dirty.TIMELINE, Dirty.CHARTS, Dirty.PROCS, Dirty.LOG})

    def _notice(self, event: protocol.EngineEvent, severity: str, text: str) -> None:
        """A notice for an engine event that happened since this dashboard opened (not one read from history)."""
        t = getattr(event, "t", None)
        if self.opened_at_host is None or t is None or t >= self.opened_at_host:
            self.notices.append((severity, text))

    def _engine_event(self, event: protocol.EngineEvent) -> None:
        self.health.add_engine_event(event)
        if isinstance(event, protocol.StepEvent):
            self.engine_steps_seen = True
            self.dirty.add(Dirty.CHARTS)
        elif isinstance(event, protocol.EvalEvent):
            self.dirty.add(Dirty.CHARTS)
            if event.error:
                self._notice(event, "warning", f"evaluation of {event.thread} failed: {event.error}")
        elif isinstance(event, protocol.StageEvent):
            self.timeline.stage = event.stage
            if event.vocab_coverage is not None:
                self.timeline.vocab_coverage = event.vocab_coverage
                if event.vocab_coverage < protocol.VOCAB_COVERAGE_WARN:
                    below = f"below {protocol.VOCAB_COVERAGE_WARN:.0%}: the drafter cannot propose the rest"
                    self.notices.append(("warning", f"{event.detail} ({below})"))
            self.dirty.add(Dirty.TIMELINE)
        elif isinstance(event, protocol.ServedEvent):
            self.dirty.add(Dirty.CHARTS)
            if event.tau is None:
                self._notice(event, "warning", f"serve-check: {event.error or 'no figures'}")
            else:
                ours = f" (ours {event.tau_ours:.2f})" if event.tau_ours is not None else ""
                self._notice(event, "information", f"served by vLLM: τ {event.tau:.2f}{ours}")
        elif isinstance(event, protocol.ExportEvent):
            self.timeline.last_export = event.path
            self._notice(event, "information", f"drafter exported to {event.path} ({event.format})")
            self.dirty.add(Dirty.TIMELINE)
        elif isinstance(event, protocol.ThreadErrorEvent):
            self._notice(event, "error", f"thread {event.thread} died: {event.exc_type}: {event.message}")
        elif isinstance(event, protocol.RunEndEvent):
            severity = "information" if event.ok else "error"
            self._notice(event, severity, f"engine finished ({'ok' if event.ok else 'failed'}): {event.reason}")
        self.dirty.add(Dirty.PROCS)

    def _parse_log_metrics(self, n: int) -> None:
        now = self.clock()
        # A sample of the newest lines is enough for a chart; parsing every line of a burst is not.
        newest = list(itertools.islice(reversed(self.log.lines), min(n, MAX_PARSED_LINES_PER_EVENT)))
        for line in reversed(newest):
            if any(h in line for h in _METRIC_HINTS) and self.charts.add_log_line(line, now):
                self.dirty.add(Dirty.CHARTS)
