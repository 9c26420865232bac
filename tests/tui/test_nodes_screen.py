"""The screen of one run across several nodes, fed decoded events (no connection): each node's rows under its own
label, one log of both nodes tagged, the failure at the top with node, rank and cause, host words kept as text."""

from __future__ import annotations

from typing import Any

from textual.app import App
from textual.screen import Screen

from engine import protocol
from tui.dashboard.screens.nodes import NodesScreen, NodesState
from tui.dashboard.widgets.gpu_bars import GpuBars
from tui.dashboard.widgets.text_line import TextLine
from tui.link.events import ConnectionEvent

LABELS = ["gpu-a", "root@gpu-b:2222"]


class _Screen(App[None]):
    def __init__(self, state: NodesState) -> None:
        super().__init__()
        self.state = state

    def get_default_screen(self) -> Screen[Any]:
        return NodesScreen(self.state)


def run(state: str, cause: str | None = None, rank: int | None = None) -> protocol.RunInfo:
    return protocol.RunInfo(
        run_id="r1", run_dir="/d", state=state, cause=cause, failed_rank=rank, milestones={"first-step": 1.0}
    )


def gpus(n: int) -> protocol.GpusEvent:
    return protocol.GpusEvent(
        1.0,
        [
            protocol.GpuInfo(index=i, name=f"GPU{i}", uuid=f"u{i}", util_pct=50.0, mem_used_mib=1.0, mem_total_mib=80.0)
            for i in range(n)
        ],
    )


def connected(state: NodesState) -> None:
    for label in LABELS:
        state.ingest(label, ConnectionEvent("connected", "ok", None))


async def test_each_node_has_its_own_gpu_rows_and_the_log_tags_both_nodes_in_order_per_node() -> None:
    state = NodesState(LABELS)
    connected(state)
    state.ingest(LABELS[0], gpus(2))
    state.ingest(LABELS[1], gpus(1))
    state.ingest(LABELS[0], protocol.LogEvent(0, 7, "step=1\nstep=2\n"))
    state.ingest(LABELS[1], protocol.LogEvent(0, 9, "[rank 1] step=1\n[rank 1] st"))
    state.ingest(LABELS[1], protocol.LogEvent(27, 9, "ep=2\n"))  # the rest of a line cut between two events
    state.ingest(LABELS[1], protocol.LogEvent(0, 9, "[rank 1] step=1\n"))  # a resent chunk: not shown twice
    app = _Screen(state)
    async with app.run_test(size=(150, 50)) as pilot:
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, NodesScreen)
        assert [len(screen.query_one(f"#gpus-{i}", GpuBars).gpus) for i in (0, 1)] == [2, 1]
        assert LABELS[1] in str(screen.query_one("#gpus-1", GpuBars).border_title)
        assert list(state.log.lines) == [
            "[gpu-a] step=1",
            "[gpu-a] step=2",
            "[root@gpu-b:2222/rank 1] step=1",
            "[root@gpu-b:2222/rank 1] step=2",
        ]


async def test_a_failure_is_named_at_the_top_with_node_rank_and_cause_and_host_words_stay_text() -> None:
    state = NodesState(LABELS)
    connected(state)
    hostile = "rank 1 (node 1) killed by SIGKILL \x1b]0;owned\x07 [bold]x[/bold]"
    state.ingest(LABELS[0], protocol.RunEvent(run("running")))
    state.ingest(LABELS[1], protocol.RunEvent(run("failed", hostile, 1)))
    app = _Screen(state)
    async with app.run_test(size=(150, 50)) as pilot:
        await pilot.pause()
        screen = app.screen
        said = screen.query_one("#failure-line", TextLine).text.plain
        assert said.startswith(" FAILED rank 1: node root@gpu-b:2222: rank 1 (node 1) killed by SIGKILL"), said
        assert "\x1b" not in said and "\x07" not in said and "[bold]x[/bold]" in said, said
        top = screen.query_one("#run-line", TextLine).text.plain
        assert "run r1 failed" in top and "first-step ✓" in top, top
        state.ingest(LABELS[1], ConnectionEvent("reconnecting", "Connection refused; retry in 0.4 s", 1))
        state.ingest(LABELS[1], protocol.RunEvent(None))
        app.screen.apply()  # type: ignore[attr-defined]
        await pilot.pause()
        said = screen.query_one("#failure-line", TextLine).text.plain
        assert said.startswith(" UNREACHABLE: node root@gpu-b:2222 unreachable: link reconnecting"), said
