"""Textual messages that carry the agent's events (decoded, tui/link/events.py) into the widget tree.

The session calls its listeners on the asyncio loop, once per event. The app buffers those
events and posts at most one ``StreamBatch`` per flush interval; connection changes are posted at
once (``ConnectionChanged``) so a lost link shows in the header without waiting for a flush.
"""

from __future__ import annotations

from typing import Any

from textual.message import Message

from engine.protocol import RunInfo
from tui.link.events import ClientEvent, ConnectionEvent


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


class StreamBatch(Message):
    """The events that arrived since the last flush, after coalescing (latest gpus/procs/anomalies/run)."""

    def __init__(self, events: list[ClientEvent], log_lines: int) -> None:
        super().__init__()
        self.events = events
        self.log_lines = log_lines  # complete log lines the log model took in during this batch


class RunChanged(Message):
    """The agent's ``run`` event: the current run's state changed (None: there is no run)."""

    def __init__(self, run: RunInfo | None) -> None:
        super().__init__()
        self.run = run


class MilestoneReached(Message):
    """The agent's ``milestone`` event: a launch milestone reached (ok) or failed (cause)."""

    def __init__(self, run_id: str | None, milestone: str, t: float | None, ok: bool, cause: str | None) -> None:
        super().__init__()
        self.run_id = run_id
        self.milestone = milestone
        self.t = t
        self.ok = ok
        self.cause = cause


class CommandFinished(Message):
    """A command the dashboard sent (launch, stop, kill_stale, stacks, ...) got its reply."""

    def __init__(self, cmd: str, ok: bool, result: dict[str, Any] | None = None, error: str | None = None) -> None:
        super().__init__()
        self.cmd = cmd
        self.ok = ok
        self.result = result
        self.error = error


class LiveReloadReady(Message):
    """The file watcher is watching these directories (changes from now on are reloaded)."""

    def __init__(self, directories: list[str]) -> None:
        super().__init__()
        self.directories = directories


class ThemesReloaded(Message):
    """Theme files changed on disk and were read again; ``errors``: files rejected (their old themes kept)."""

    def __init__(self, names: list[str], errors: list[str]) -> None:
        super().__init__()
        self.names = names
        self.errors = errors


class ProfilesReloaded(Message):
    """The profiles' config file changed on disk; ``error`` set: it was rejected and the old profiles kept."""

    def __init__(self, profile: str | None, error: str | None) -> None:
        super().__init__()
        self.profile = profile
        self.error = error
