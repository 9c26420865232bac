"""The launch timeline: submitted → started → output → first-step, each with its time or its cause."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rich.console import RenderableType
from rich.text import Text

from engine.protocol import MILESTONES, VOCAB_COVERAGE_WARN, MilestoneEvent, RunInfo
from tui import restarts
from tui.dashboard.widgets.text_line import RowTracking
from tui.hosttext import printable, printable_rendered


@dataclass
class MilestoneState:
    t: float | None = None
    ok: bool | None = None  # None: not reached yet
    cause: str | None = None


@dataclass
class TimelineModel:
    run_id: str | None = None
    started_at: float | None = None
    milestones: dict[str, MilestoneState] = field(default_factory=dict)
    stage: str | None = None
    run_state: str | None = None
    exit_cause: str | None = None
    stopped_as: str | None = None  # a run that ended on a stop, cleanly: how (said muted, not as a cause)
    restarts: list[dict[str, Any]] = field(default_factory=list)  # the run's restarts, oldest first
    restart_max: int | None = None
    last_export: str | None = None  # OUT_DIR of the newest `specdec-train export` of this run
    vocab_coverage: float | None = None  # share of the trained tokens the draft vocabulary holds (stage data)

    def reset(self, run_id: str | None) -> None:
        self.run_id = run_id
        self.started_at = None
        self.milestones = {}
        self.stage = None
        self.run_state = None
        self.exit_cause = None
        self.stopped_as = None
        self.restarts = []
        self.restart_max = None
        self.last_export = None
        self.vocab_coverage = None

    def from_run(self, run: RunInfo | None) -> None:
        if run is None:
            return
        if run.run_id != self.run_id:
            self.reset(run.run_id)
        self.started_at = run.started_at if run.started_at is not None else self.started_at
        for name, t in run.milestones.items():
            state = self.milestones.setdefault(name, MilestoneState())
            if t is not None:
                state.t = t
                if state.ok is None:
                    state.ok = True
        self.stage = run.stage or self.stage
        self.restarts = restarts.restarts_of(run)
        self.restart_max = run.restart_max
        self.last_export = run.last_export or self.last_export
        self.run_state = run.state or self.run_state
        if self.run_state in ("failed", "vanished", "rebooted"):
            if run.cause:
                self.exit_cause = f"failed: {run.cause}"  # the root cause, exit code and last step, from the host
            elif run.signal:
                self.exit_cause = f"killed by signal {run.signal}"
            elif run.exit_code is not None:
                self.exit_cause = f"exited with code {run.exit_code}"
            else:
                self.exit_cause = self.run_state
        elif self.run_state == "stopped":
            self.exit_cause, self.stopped_as = None, run.cause or "stopped"

    def from_milestone(self, event: MilestoneEvent) -> None:
        if event.run_id is not None and event.run_id != self.run_id:
            self.reset(event.run_id)
        state = self.milestones.setdefault(event.milestone, MilestoneState())
        state.t = event.t if event.t is not None else state.t
        state.ok = event.ok
        state.cause = event.cause

    def origin(self) -> float | None:
        sub = self.milestones.get("submitted")
        if sub is not None and sub.t is not None:
            return sub.t
        return self.started_at


class RunTimeline(RowTracking):
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "run-timeline--ok",
        "run-timeline--failed",
        "run-timeline--pending",
        "run-timeline--cause",
    }
    DEFAULT_CSS = """
    RunTimeline { height: auto; padding: 0 1; }
    RunTimeline > .run-timeline--ok { color: $success; }
    RunTimeline > .run-timeline--failed { color: $error; text-style: bold; }
    RunTimeline > .run-timeline--pending { color: $text-muted; }
    RunTimeline > .run-timeline--cause { color: $error; }
    """

    def __init__(self, model: TimelineModel, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model = model

    def render(self) -> RenderableType:
        model = self.model
        ok = self.get_component_rich_style("run-timeline--ok")
        failed = self.get_component_rich_style("run-timeline--failed")
        pending = self.get_component_rich_style("run-timeline--pending")
        cause_style = self.get_component_rich_style("run-timeline--cause")
        out = Text(no_wrap=False)
        if model.run_id is None:
            out.append("launch: no run yet (press l to launch)", style=pending)
            return self.track_rows(out)
        origin = model.origin()
        causes: list[str] = []
        for i, name in enumerate(MILESTONES):
            if i:
                out.append(" → ", style=pending)
            state = model.milestones.get(name)
            if state is None or state.ok is None:
                out.append(f"○ {name}", style=pending)
                continue
            when = f" +{state.t - origin:.1f}s" if state.t is not None and origin is not None else ""
            if state.ok:
                out.append(f"● {name}{when}", style=ok)
            else:
                out.append(f"✗ {name}{when}", style=failed)
                if state.cause:
                    causes.append(f"{name}: {printable(state.cause)}")
        if model.stage:
            out.append(f"   stage {printable(model.stage)}", style=pending)
        if model.vocab_coverage is not None:
            low = model.vocab_coverage < VOCAB_COVERAGE_WARN
            out.append(
                f"   draft vocab holds {model.vocab_coverage:.1%} of trained tokens{' (low)' if low else ''}",
                style=cause_style if low else pending,
            )
        if model.last_export:
            out.append(f"   exported {printable(model.last_export)}", style=pending)
        if not causes and model.exit_cause:
            causes.append(f"run {printable(model.exit_cause)}")
        for i, item in enumerate(model.restarts, start=1):
            out.append(f"\n  ↻ {printable(restarts.line(i, item, model.restart_max))}", style=cause_style)
        for cause in causes:
            out.append(f"\n  cause: {cause}", style=cause_style)
        if model.stopped_as and not causes:
            out.append(f"\n  run {printable(model.stopped_as)}", style=pending)
        return self.track_rows(printable_rendered(out))
