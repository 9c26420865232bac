"""The events a session's listeners receive: the agent's, decoded into engine.protocol's dataclasses, and the
session's own (its connection state, and a message it could not decode).

Decoding happens once, where a line arrives (``tui.link.session.Session``); everything after it (the dashboard's models
and widgets, the headless commands) reads typed fields. A message that does not decode is not dropped and does
not raise: it becomes an ``Undecodable`` event that the dashboard and the CLI show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from engine import protocol


@dataclass
class ConnectionEvent:
    """The session's link changed: "connecting" | "connected" | "reconnecting" | "disconnected" | "failed"."""

    EV: ClassVar[str] = "connection"
    state: str
    detail: str = ""
    attempt: int | None = None  # the reconnect attempt (0 once connected)


@dataclass
class Undecodable:
    """An agent event that is JSON but not the protocol: its ``ev`` and what did not match."""

    EV: ClassVar[str] = "undecodable"
    ev: str | None
    reason: str

    @property
    def message(self) -> str:
        return f"event {self.ev!r} from the agent not understood: {self.reason}"


ClientEvent = protocol.Event | ConnectionEvent | Undecodable


def decode(obj: dict[str, Any]) -> protocol.Event | Undecodable:
    """One parsed agent line as its dataclass, or the reason it is not one."""
    try:
        return protocol.decode_event(obj)
    except protocol.ProtocolError as exc:
        kind = obj.get("ev")
        return Undecodable(kind if isinstance(kind, str) else None, str(exc))
