"""A run's restarts where a person looks: the dashboard header, the timeline, a notice per restart, `status`."""

from __future__ import annotations

from typing import Any

from textual.app import App, ComposeResult

from engine import protocol
from tui.cli.monitor import format_status
from tui.dashboard.state import DashboardState
from tui.dashboard.widgets.header import RunHeader
from tui.dashboard.widgets.run_timeline import RunTimeline
from tui.link.events import decode

CRASH = {"attempt": 1, "cause": "crash", "at": 1000.0, "exit_code": 1, "detail": "exited with code 1"}
OOM = {
    "attempt": 2,
    "cause": "oom",
    "at": 1100.0,
    "exit_code": 1,
    "detail": "exited with code 1 (CUDA out of memory: torch.OutOfMemoryError: CUDA out of memory.)",
}


def run(*restarts: dict[str, Any], state: str = "watching") -> dict[str, Any]:
    return {
        "run_id": "r1",
        "run_dir": "/root/.specdec/runs/r1",
        "state": "running",
        "milestones": {"submitted": 990.0, "started": 991.0},
        "restarts": list(restarts),
        "restart_max": 3,
        "restart_state": state,
    }


class _Top(App[None]):
    def __init__(self, state: DashboardState) -> None:
        super().__init__()
        self.state = state

    def compose(self) -> ComposeResult:
        yield RunHeader(self.state.header, id="header")
        yield RunTimeline(self.state.timeline, id="timeline")


async def test_the_header_and_timeline_show_each_restart_with_its_cause() -> None:
    state = DashboardState("root@gpu-box")
    state.ingest(decode({"ev": "run", "run": run()}))
    assert state.header.restarts == "restarts 0/3" and not state.notices
    state.health.mark_dead("drafter0", "RuntimeError: boom")
    state.ingest(decode({"ev": "run", "run": run(CRASH, OOM, state="backoff")}))
    assert not state.health.threads  # the restarted attempt's threads are new
    assert state.header.restarts == "restarts 2/3 (crash, oom), restarting"
    notices = [text for _, text in state.notices]
    assert len(notices) == 2 and notices[1].startswith("run r1: restart 2/3 at ")
    assert notices[1].endswith(f": oom: {OOM['detail']}")
    state.ingest(decode({"ev": "run", "run": run(CRASH, OOM)}))
    assert len(state.notices) == 2  # the same restarts again: no new notice
    app = _Top(state)
    async with app.run_test(size=(160, 12)) as pilot:
        await pilot.pause()
        header = app.query_one(RunHeader).render().plain  # type: ignore[union-attr]
        timeline = app.query_one(RunTimeline).render().plain  # type: ignore[union-attr]
    assert "run r1 running  restarts 2/3 (crash, oom)" in header
    assert "↻ restart 1/3 at " in timeline and ": crash: exited with code 1" in timeline
    assert "↻ restart 2/3 at " in timeline and ": oom: exited with code 1 (CUDA out of memory" in timeline


def test_status_lists_the_restarts_and_says_when_it_gave_up() -> None:
    snap = {"host": {}, "gpus": [], "processes": {}, "anomalies": [], "run": run(CRASH, OOM, state="gave_up")}
    text = format_status(protocol.from_json(protocol.StatusReply, snap), None, "root@gpu-box")
    assert "  restarts 2/3 (crash, oom), gave up" in text
    assert "    restart 1/3 at " in text and "    restart 2/3 at " in text


def test_a_run_without_a_restart_policy_says_nothing_of_restarts() -> None:
    plain = {"run_id": "r2", "run_dir": "/x", "state": "running", "restarts": [], "restart_max": None}
    state = DashboardState("local")
    state.ingest(decode({"ev": "run", "run": plain}))
    assert state.header.restarts is None
    snap = {"host": {}, "gpus": [], "processes": {}, "anomalies": [], "run": plain}
    assert "restart" not in format_status(protocol.from_json(protocol.StatusReply, snap), None, "local")


async def test_a_stopped_run_reads_stopped_in_the_header_and_timeline_with_no_failure_cause() -> None:
    said = "stopped (SIGTERM), torchrun exited with code 1; every rank ended cleanly"
    state = DashboardState("root@gpu-box")
    state.ingest(decode({"ev": "run", "run": {**run(), "state": "stopped", "exit_code": 1, "cause": said}}))
    assert state.header.failed_rank is None
    app = _Top(state)
    async with app.run_test(size=(160, 12)) as pilot:
        await pilot.pause()
        header = app.query_one(RunHeader).render().plain  # type: ignore[union-attr]
        timeline = app.query_one(RunTimeline).render().plain  # type: ignore[union-attr]
    assert "run r1 stopped" in header and "fail" not in header.lower()
    assert f"run {said}" in timeline and "cause:" not in timeline and "failed" not in timeline
