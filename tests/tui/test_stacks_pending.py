"""`d` answers at once: the stacks screen opens with "dumping stacks…" before the host has replied."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from support.pilot import wait_until
from tui_recorded import RecordingSession

from tui.dashboard.app import DashboardApp
from tui.dashboard.screens.stacks import StacksScreen

SIZE = (120, 40)
DUMP = 'Thread drafter0 (native id 7), most recent call last:\n  File "worker.py", line 3, in _loop'


class GatedSession(RecordingSession):
    """Holds the `stacks` reply until the test opens the gate (a slow host)."""

    def __init__(self, reply: dict[str, Any] | Exception) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.reply = reply

    async def request(
        self, cmd: str, *, timeout_s: float | None = None, params: dict[str, Any] | None = None, **args: Any
    ) -> dict[str, Any]:
        self.requests.append((cmd, {**args, **(params or {})}))
        await self.gate.wait()
        if isinstance(self.reply, Exception):
            raise self.reply
        return dict(self.reply)


def stacks_text(app: DashboardApp) -> str:
    screen = app.screen
    assert isinstance(screen, StacksScreen)
    return f"{screen.query_one('#stacks-title').render()}\n{screen.query_one('#stacks-text').render()}"


async def test_stacks_key_shows_the_pending_text_before_the_reply(recorded_app: Callable[..., DashboardApp]) -> None:
    session = GatedSession({"method": "SIGUSR1 to pid 7: named threads", "text": DUMP})
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("d")
        await wait_until(pilot, lambda: isinstance(app.screen, StacksScreen), what="the stacks screen, at once")
        assert "dumping stacks…" in stacks_text(app)
        assert session.commands() == ["stacks"]
        session.gate.set()
        await wait_until(pilot, lambda: "drafter0" in stacks_text(app), what="the dump")
        assert "dumping stacks…" not in stacks_text(app) and "named threads" in stacks_text(app)


async def test_a_failed_dump_replaces_the_pending_text_with_the_reason(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    session = GatedSession(RuntimeError("run 2026 is not running (exited): no stacks to dump"))
    app = recorded_app(session)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("d")
        await wait_until(pilot, lambda: isinstance(app.screen, StacksScreen))
        session.gate.set()
        await wait_until(pilot, lambda: "is not running" in stacks_text(app), what="the reason")
        assert "dumping stacks…" not in stacks_text(app)
