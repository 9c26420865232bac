"""Agent events are decoded once, at the session, into engine.protocol's dataclasses: every kind the client
reads round-trips through the wire unchanged, a line that is JSON but not the protocol becomes a visible
``Undecodable`` (never a crash, never silence), and the session keeps its stream positions either way."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from tui_recorded import healthy_events

from engine import protocol
from tui.dashboard.state import DashboardState
from tui.link.events import ConnectionEvent, Undecodable, decode
from tui.link.session import ConnectOptions, ReplyNotUnderstood, Session
from tui.link.transport import LocalTransport, Target


def test_every_recorded_event_decodes_into_its_dataclass_and_its_wire_object_decodes_to_the_same() -> None:
    kinds = set()
    for obj in healthy_events():
        if obj["ev"] == "connection":  # the session's own, never decoded from the agent
            continue
        typed = decode(obj)
        assert not isinstance(typed, Undecodable), typed
        kinds.add(type(typed).__name__)
        again = decode(protocol.event_to_wire(typed))
        assert again == typed
    assert kinds >= {"HelloEvent", "GpusEvent", "RunEvent", "ProcsEvent", "AnomaliesEvent", "LogEvent"}
    assert "EngineLineEvent" in kinds


@pytest.mark.parametrize(
    ("obj", "reason"),
    [
        ({"ev": "log", "offset": "12", "inode": 7, "data": ""}, "log.offset: expected an integer, got str"),
        ({"ev": "gpus", "gpus": []}, "gpus: no 't'"),
        ({"ev": "engine", "event": {"kind": "step", "step": "3"}}, "engine.event (step).step: expected an integer"),
        ({"ev": "engine", "event": {"kind": "teleport"}}, "unknown engine event kind 'teleport'"),
        ({"ev": "run", "run": {"run_id": "r1"}}, "run.run: no 'run_dir'"),
        ({"ev": "zzz"}, "unknown event 'zzz'"),
    ],
)
def test_a_line_that_is_not_the_protocol_says_which_field_is_wrong(obj: dict[str, Any], reason: str) -> None:
    typed = decode(obj)
    assert isinstance(typed, Undecodable) and reason in typed.reason and typed.ev == obj["ev"]


def test_the_dashboard_shows_undecodable_events_counted_and_each_kind_once_in_words() -> None:
    state = DashboardState("local")
    for offset in ("1", "2", "3"):
        state.ingest(decode({"ev": "log", "offset": offset, "inode": 7, "data": "x"}))
    state.ingest(decode({"ev": "anomalies", "items": [{"kind": "stale_holder"}]}))
    assert state.header.undecodable == 4 and "header" in state.dirty
    said = [text for severity, text in state.notices if severity == "error"]
    assert len(said) == 2 and said[0].startswith("event 'log' from the agent not understood: log.offset")
    assert "anomalies.items[0]: no 'message'" in said[1]
    assert state.log.total_lines == 0  # nothing of a bad event reaches a model


def test_the_session_decodes_once_and_keeps_its_positions_for_bad_engine_lines() -> None:
    session = Session(LocalTransport(Target(local=True), ConnectOptions()), ConnectOptions())
    typed: list[Any] = []
    session.add_event_listener(typed.append)
    session._on_event({"ev": "engine", "offset": 120, "event": {"kind": "step", "step": 3, "thread": "d0"}})
    session._on_event({"ev": "engine", "offset": 240, "event": {"kind": "step", "step": "four"}})
    session._on_event({"ev": "connection", "state": "failed"})  # only the session may say that
    assert isinstance(typed[0], protocol.EngineLineEvent) and isinstance(typed[0].event, protocol.StepEvent)
    assert typed[0].event.step == 3 and typed[0].event.thread == "d0"
    assert isinstance(typed[1], Undecodable) and "step: expected an integer" in typed[1].reason
    assert session.engine_offset == 240  # a resumed stream starts after the bad line, not at it
    assert not any(isinstance(ev, ConnectionEvent) for ev in typed)
    assert isinstance(typed[2], protocol.WarningEvent) and "only the session may emit" in typed[2].message


def test_another_engines_own_event_kind_is_skipped_quietly_and_its_offset_kept() -> None:
    session = Session(LocalTransport(Target(local=True), ConnectOptions()), ConnectOptions())
    typed: list[Any] = []
    session.add_event_listener(typed.append)
    session._on_event({"ev": "engine", "offset": 80, "event": {"kind": "teleport", "to": "mars"}})
    assert typed == [] and session.engine_offset == 80  # not an error: a custom engine may log its own kinds


def test_a_reply_that_does_not_decode_fails_its_command_at_once() -> None:
    async def scenario() -> None:
        session = Session(LocalTransport(Target(local=True), ConnectOptions()), ConnectOptions())
        fut: asyncio.Future[protocol.ReplyEvent] = asyncio.get_running_loop().create_future()
        session._pending[5] = fut
        session._on_event({"ev": "reply", "id": 5, "ok": "yes"})
        assert fut.done() and isinstance(fut.exception(), ReplyNotUnderstood)
        assert "not understood" in str(fut.exception()) and 5 not in session._pending

    asyncio.run(scenario())
