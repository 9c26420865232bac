"""The process pane under torchrun: every rank has threads named drafter0 and target0; each rank's threads sit
under its own process (named by the rank's `distributed` stage event), and a dead thread is marked on its rank."""

from __future__ import annotations

from typing import Any

from textual.app import App, ComposeResult

from engine.protocol import ProcsEvent, decode_engine_event, from_json
from tui.dashboard.widgets.proc_tree import ProcTree, ThreadHealthModel
from tui.link.events import decode


class _Pane(App[None]):
    def __init__(self, health: ThreadHealthModel) -> None:
        super().__init__()
        self.health = health

    def compose(self) -> ComposeResult:
        yield ProcTree(self.health, clock=lambda: 100.0, id="procs")


def rank_events(rank: int, pid: int, *, dead: str | None = None) -> list[Any]:
    tags = {"rank": rank, "world_size": 2, "node": 0}
    out: list[dict[str, Any]] = [{"t": 99.0, "kind": "stage", "stage": "distributed", "pid": pid, **tags}]
    for thread in ("target0", "drafter0"):
        out.append({"t": 99.5, "kind": "heartbeat", "thread": thread, "state": "running", "step": 7, **tags})
    if dead is not None:
        out.append({"t": 99.6, "kind": "thread_error", "thread": dead, "exc_type": "RuntimeError",
                    "message": "boom on rank 1", **tags})  # fmt: skip
    return [decode_engine_event(ev) for ev in out]


def rank_proc(pid: int, ppid: int) -> dict[str, Any]:
    threads = [
        {"tid": pid, "name": "python3"},
        {"tid": pid + 1, "name": "target0"},
        {"tid": pid + 2, "name": "drafter0"},
    ]
    return {**PROC, "pid": pid, "ppid": ppid, "cmd": "python3 -u -m engine.trainer", "threads": threads}


PROC = {"user": "root", "cpu_pct": None, "rss_mib": None, "create_time": None, "state": None}


def procs(*tree: dict[str, Any]) -> ProcsEvent:
    return from_json(ProcsEvent, {"t": 100.0, "run_tree": list(tree)})


async def test_each_ranks_threads_are_listed_under_its_process_and_a_dead_one_on_its_rank() -> None:
    health = ThreadHealthModel()
    for ev in rank_events(0, 201):
        health.add_engine_event(ev)
    for ev in rank_events(1, 202, dead="drafter0"):
        health.add_engine_event(ev, main_file=False)
    app = _Pane(health)
    async with app.run_test() as pilot:
        pane = app.query_one(ProcTree)
        torchrun = {**PROC, "pid": 200, "ppid": 1, "cmd": "python3 -m torch.distributed.run", "threads": []}
        pane.update_procs(procs(torchrun, rank_proc(201, 200), rank_proc(202, 200)))
        await pilot.pause()
        text = pane.render().plain  # type: ignore[union-attr]
    rank0, _, rank1 = text.partition("202 ")
    assert "rank 0 (node 0)" in rank0 and "rank 1 (node 0)" in rank1
    assert rank0.count("drafter0") == 1 and "DEAD" not in rank0
    assert "drafter0    DEAD" in rank1 and "boom on rank 1" in rank1 and "target0     running" in rank1


async def test_threads_of_a_rank_not_in_the_process_table_are_grouped_by_rank() -> None:
    health = ThreadHealthModel()
    for ev in rank_events(0, 201) + rank_events(1, 202):
        health.add_engine_event(ev)
    app = _Pane(health)
    async with app.run_test() as pilot:
        pane = app.query_one(ProcTree)
        pane.update_procs(procs())
        await pilot.pause()
        text = pane.render().plain  # type: ignore[union-attr]
    assert "rank 0: drafter0, target0" in text and "rank 1: drafter0, target0" in text


def test_the_dashboard_header_and_timeline_name_the_failed_node_and_rank() -> None:
    from tui.dashboard.state import DashboardState

    state = DashboardState("local", clock=lambda: 100.0)
    cause = "rank 1 (node 1) failed or left the run; rank 0 (node 0) said: peer rank 1 (node 1, b pid 7) is gone"
    run = {"run_id": "r1", "run_dir": "/runs/r1", "state": "failed", "exit_code": 1, "cause": cause}
    run.update(failed_rank=1, failed_node=1)
    state.ingest(decode({"ev": "run", "run": run}))
    assert state.header.failed_rank == "rank 1 (node 1)"
    assert state.timeline.exit_cause is not None and state.timeline.exit_cause.startswith("failed: rank 1 (node 1)")
    # Another rank's events (forwarded with their file's name) feed the threads' health, not the run's charts.
    beat = {"t": 99.0, "kind": "step", "thread": "drafter0", "step": 3, "rank": 1, "world_size": 2, "node": 0}
    state.ingest(decode({"ev": "engine", "run_id": "r1", "source": "events.rank1.jsonl", "event": beat}))
    assert state.health.threads[(1, "drafter0")].step == 3 and not state.charts.series
