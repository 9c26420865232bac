"""Every pane is declared once (tui/dashboard/panes.py) and both screens compose and draw it from there: each
declared pane is on the one-node screen under its id, and each node pane once per node on the nodes screen, titled
with the node."""

from __future__ import annotations

from typing import Any

from textual.app import App
from textual.screen import Screen

from tui.dashboard import panes
from tui.dashboard.panes import Pane
from tui.dashboard.screens.dashboard import PANES, DashboardScreen
from tui.dashboard.screens.nodes import NODE_PANES, NodesScreen, NodesState
from tui.dashboard.state import DashboardState, Dirty

DECLARED = [v for v in vars(panes).values() if isinstance(v, Pane)]


class _App(App[None]):
    def __init__(self, screen: Screen[None]) -> None:
        super().__init__()
        self.first = screen

    def get_default_screen(self) -> Screen[Any]:
        return self.first


def test_the_dashboard_draws_every_declared_pane_each_under_its_own_key_and_id() -> None:
    assert sorted(p.id for p in PANES) == sorted(p.id for p in DECLARED)
    assert len({p.key for p in DECLARED}) == len({p.id for p in DECLARED}) == len(DECLARED)
    keys = {v for k, v in vars(Dirty).items() if k.isupper()}
    assert {p.key for p in DECLARED} == keys


async def test_each_declared_pane_is_mounted_on_the_dashboard_under_its_id() -> None:
    app = _App(DashboardScreen(DashboardState("host")))
    async with app.run_test(size=(120, 40)):
        for pane in PANES:
            assert app.screen.query_one(f"#{pane.id}", pane.widget) is not None


async def test_the_nodes_screen_shows_each_node_pane_once_per_node_titled_with_the_node() -> None:
    app = _App(NodesScreen(NodesState(["gpu-a", "gpu-b"])))
    async with app.run_test(size=(150, 50)):
        for i, label in enumerate(["gpu-a", "gpu-b"]):
            for pane in NODE_PANES:
                widget = app.screen.query_one(f"#{pane.node_id(i)}", pane.widget)
                assert widget.border_title == f"{pane.title} · node {i} · {label}"
        assert app.screen.query_one(f"#{panes.LOG.id}", panes.LOG.widget) is not None
