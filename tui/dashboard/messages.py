"""The one Textual message the dashboard posts to itself: the link's state changed.

The session calls the app's listener on the asyncio loop, once per event; the app folds every event into
``DashboardState`` and draws what changed at most once per flush interval. A connection change alone is
posted at once (``ConnectionChanged``), so a lost link shows in the header without waiting for a flush.
"""

from __future__ import annotations

from textual.message import Message

from tui.link.events import ConnectionEvent


class ConnectionChanged(Message):
    """The session's ``ConnectionEvent``."""

    def __init__(self, state: str, detail: str | None = None, attempt: int | None = None) -> None:
        super().__init__()
        self.state = state
        self.detail = detail
        self.attempt = attempt

    @classmethod
    def from_event(cls, event: ConnectionEvent) -> ConnectionChanged:
        return cls(event.state, event.detail or None, event.attempt)
