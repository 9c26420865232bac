"""The engine's ``eval`` events reach the training pane: one τ series per drafter, per-position acceptance beside it."""

from __future__ import annotations

from typing import Any

from textual.app import App, ComposeResult

from tui.dashboard.state import DashboardState
from tui.dashboard.widgets.charts import ChartModel, Charts
from tui.link.events import decode


def eval_event(thread: str, step: int, tau: float, per: list[float]) -> dict[str, Any]:
    return {
        "t": 1000.0 + step,
        "kind": "eval",
        "thread": thread,
        "step": step,
        "tau": tau,
        "k": len(per),
        "per_position": per,
        "per_position_conditional": per,
        "rounds": 40,
        "prompts": 8,
        "new_tokens": 96,
    }


def wire(offset: int, event: dict[str, Any]) -> dict[str, Any]:
    """The agent's ``engine`` event carrying one events.jsonl line."""
    return {"ev": "engine", "offset": offset, "inode": 7, "run_id": "r1", "event": event}


class ChartsApp(App[None]):
    def __init__(self, model: ChartModel) -> None:
        super().__init__()
        self.model = model

    def compose(self) -> ComposeResult:
        yield Charts(self.model, id="charts")


async def test_eval_events_chart_tau_per_drafter_with_the_latest_acceptance_per_position() -> None:
    state = DashboardState(target="local")
    feed = [
        eval_event("drafter0", 100, 1.40, [0.3, 0.2, 0.1]),
        eval_event("drafter1", 100, 1.20, [0.2, 0.1, 0.0]),
        eval_event("drafter0", 200, 2.75, [1.0, 0.6, 0.3]),
    ]
    for i, ev in enumerate(feed):
        state.ingest(decode(wire(100 * (i + 1), ev)))
    repeated = wire(300, eval_event("drafter0", 200, 2.75, [1.0, 0.6, 0.3]))  # a resumed stream repeats a line
    state.ingest(decode(repeated))
    assert "charts" in state.dirty
    assert state.charts.series[("tau", "drafter0")].values() == [1.40, 2.75]
    assert state.charts.series[("tau", "drafter1")].values() == [1.20]
    assert state.charts.accept_latest["drafter0"] == [1.0, 0.6, 0.3]

    app = ChartsApp(state.charts)
    async with app.run_test(size=(100, 10)):
        rows = app.query_one(Charts).render()
    lines = str(rows).splitlines()
    tau0 = next(line for line in lines if line.startswith("tau    drafter0"))
    tau1 = next(line for line in lines if line.startswith("tau    drafter1"))
    assert "2.75 @200" in tau0 and "acc_j █▅▃" in tau0  # 1.0, 0.6, 0.3 as bars
    assert "1.20 @100" in tau1


def test_a_failed_evaluation_is_a_notice_and_no_point() -> None:
    state = DashboardState(target="local")
    failed = {"t": 1.0, "kind": "eval", "thread": "drafter0", "step": 10, "error": "ValueError: boom"}
    state.ingest(decode(wire(50, failed)))
    assert ("tau", "drafter0") not in state.charts.series
    assert ("warning", "evaluation of drafter0 failed: ValueError: boom") in state.notices


def served_event(**fields: Any) -> dict[str, Any]:
    return {"t": 2000.0, "kind": "served", **fields}


async def test_a_served_check_shows_vllms_tau_under_the_trained_one() -> None:
    state = DashboardState(target="local")
    state.ingest(decode(wire(100, eval_event("drafter0", 1500, 1.86, [0.44, 0.59, 0.60]))))
    served = served_event(
        export="/runs/out/exports/step_00001500", step=1500, k=3, tau=1.8993, tau_ours=1.8993,
        per_position=[0.4554, 0.2799, 0.164], prompts=32, outputs_equal=32, vllm="0.32.0",
    )  # fmt: skip
    state.ingest(decode(wire(200, served)))
    assert ("information", "served by vLLM: τ 1.90 (ours 1.90)") in state.notices
    app = ChartsApp(state.charts)
    async with app.run_test(size=(120, 10)):
        lines = str(app.query_one(Charts).render()).splitlines()
    row = next(line for line in lines if line.startswith("served"))
    assert "τ 1.90 @1500 k 3  ours 1.90  acc_i 0.46 0.28 0.16  greedy-equal 32/32" in row, row
    assert lines.index(row) > next(i for i, line in enumerate(lines) if line.startswith("tau"))


async def test_a_check_without_vllm_says_why_literally() -> None:
    state = DashboardState(target="local")
    state.ingest(decode(wire(100, eval_event("drafter0", 10, 1.2, [0.2]))))
    state.ingest(decode(wire(200, served_event(error="vLLM is not installed for /usr/bin/python3 [/data]"))))
    assert ("warning", "serve-check: vLLM is not installed for /usr/bin/python3 [/data]") in state.notices
    app = ChartsApp(state.charts)
    async with app.run_test(size=(120, 10)):
        lines = str(app.query_one(Charts).render()).splitlines()
    assert any(line.startswith("served") and "not installed for /usr/bin/python3 [/data]" in line for line in lines)


def test_a_new_run_does_not_keep_the_last_runs_served_row() -> None:
    state = DashboardState(target="local")
    state.ingest(decode(wire(100, served_event(step=1500, k=3, tau=2.05, tau_ours=2.05))))
    assert state.charts.served is not None
    state.charts.clear()
    assert state.charts.served is None
