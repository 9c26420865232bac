"""`specdec-tui connect` on a target with no active run offers to launch the profile's run; `--launch` starts
it without asking; pressing launch before the offer appears never launches twice. Real local agent."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from support.pilot import wait_until
from test_dashboard_live import SIZE, STEP_SCRIPT

from engine.protocol import to_jsonable
from tui.dashboard.app import DashboardApp
from tui.dashboard.screens.confirm import ConfirmScreen
from tui.profiles import Profile

PROFILE = Profile(name="steps", command=[sys.executable, "-c", STEP_SCRIPT])


async def test_connect_offers_a_launch_and_l_accepts_it(
    local_session_factory: Callable[..., Any], cleanup_runs: list[dict[str, Any]]
) -> None:
    session = local_session_factory()
    app = DashboardApp(session, profile=PROFILE, on_connect="offer")
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 20, "the launch offer")
            assert "No run is active" in app.screen.title_text  # type: ignore[attr-defined]
            assert STEP_SCRIPT.split("\n")[0] in app.screen.body  # type: ignore[attr-defined]
            await pilot.press("l")
            await wait_until(pilot, lambda: app.state.run and app.state.run.state == "running", 20, "run")
            cleanup_runs.append(to_jsonable(app.state.run))
            assert not isinstance(app.screen, ConfirmScreen)
    finally:
        await session.close()


async def test_declining_the_offer_starts_nothing(local_session_factory: Callable[..., Any], run_root: Any) -> None:
    session = local_session_factory()
    app = DashboardApp(session, profile=PROFILE, on_connect="offer")
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: isinstance(app.screen, ConfirmScreen), 20, "the launch offer")
            await pilot.press("n")
            await wait_until(pilot, lambda: not isinstance(app.screen, ConfirmScreen), 5, "offer closed")
            status = await session.request("status")
            assert status["run"] is None
            runs = run_root / "runs"
            assert not runs.exists() or not any(runs.iterdir())
    finally:
        await session.close()


async def test_connect_with_launch_starts_the_run_without_asking(
    local_session_factory: Callable[..., Any], cleanup_runs: list[dict[str, Any]]
) -> None:
    session = local_session_factory()
    app = DashboardApp(session, profile=PROFILE, on_connect="launch")
    try:
        async with app.run_test(size=SIZE) as pilot:
            await wait_until(pilot, lambda: app.state.run and app.state.run.state == "running", 20, "run")
            cleanup_runs.append(to_jsonable(app.state.run))
            assert not isinstance(app.screen, ConfirmScreen)
            status = await session.request("status")
            assert status["run"]["run_id"] == app.state.run.run_id
    finally:
        await session.close()
