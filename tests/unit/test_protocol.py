"""The wire protocol: round trips, lossless log bytes, and a parser that rejects junk without crashing."""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import protocol

FUZZ = settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@given(st.binary(max_size=4096))
@settings(max_examples=2_000, deadline=None)
def test_log_bytes_round_trip_through_a_json_line_byte_for_byte(data: bytes) -> None:
    line = protocol.encode(protocol.event("log", offset=0, inode=1, data=protocol.encode_log_data(data)))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    back = protocol.parse_event(line)
    assert protocol.decode_log_data(back["data"]) == data


@given(st.binary(max_size=2048))
@FUZZ
def test_command_parser_on_arbitrary_bytes_returns_or_raises_protocol_error(line: bytes) -> None:
    try:
        cmd_id, cmd, args = protocol.parse_command(line)
    except protocol.ProtocolError:
        return
    assert isinstance(cmd, str) and cmd
    assert isinstance(args, dict)
    assert cmd_id is None or isinstance(cmd_id, int)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@given(json_values)
@FUZZ
def test_command_parser_on_arbitrary_json_values_never_crashes(value: object) -> None:
    line = json.dumps(value)
    try:
        protocol.parse_command(line)
    except protocol.ProtocolError as exc:
        assert str(exc)


def test_deeply_nested_json_is_a_protocol_error_not_a_crash() -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_command("[" * 100_000 + "]" * 100_000)


def test_non_finite_floats_become_null_on_the_wire() -> None:
    line = protocol.encode({"ev": "gpus", "x": float("nan"), "y": [float("inf"), 1.5]})
    assert json.loads(line) == {"ev": "gpus", "x": None, "y": [None, 1.5]}


def test_dataclasses_encode_as_objects() -> None:
    gpu = protocol.GpuInfo(index=0, name="H200", uuid="GPU-1", util_pct=5.0, mem_used_mib=1.0, mem_total_mib=2.0)
    obj = json.loads(protocol.encode(protocol.event("gpus", gpus=[gpu])))
    assert obj["gpus"][0]["name"] == "H200"
    assert obj["gpus"][0]["holder_pids"] == []


@pytest.mark.parametrize(
    "line, message",
    [
        (b'{"cmd": 3}', "no 'cmd'"),
        (b'{"cmd": "ping", "id": "7"}', "id must be an integer"),
        (b'{"cmd": "ping", "id": true}', "id must be an integer"),
        (b'{"cmd": "ping", "args": [1]}', "'args' must be an object"),
        (b"[1, 2]", "expected a JSON object"),
        (b"\xff\xfe", "not a JSON line"),
    ],
)
def test_malformed_commands_say_what_is_wrong(line: bytes, message: str) -> None:
    with pytest.raises(protocol.ProtocolError, match=message):
        protocol.parse_command(line)


ROOMS = ("agent_events", "engine_events", "payloads", "replies", "run_words", "typed_json", "wire")


def defined_names(path: str) -> set[str]:
    """The public names a module's top level defines (classes, functions, assignments), from its source."""
    names: set[str] = set()
    for node in ast.parse(Path(path).read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {name for name in names if not name.startswith("_") and name != "T"}  # T: from_json's type variable


def test_every_public_name_of_every_room_is_re_exported_by_the_package() -> None:
    """Callers import engine.protocol, never a room: each name a room defines reaches them through ``__all__``."""
    assert tuple(m.name for m in pkgutil.iter_modules(protocol.__path__)) == ROOMS
    exported: list[str] = []
    for room in ROOMS:
        module = importlib.import_module(f"engine.protocol.{room}")
        assert module.__file__ is not None
        defined = defined_names(module.__file__)
        assert defined <= set(protocol.__all__), (room, sorted(defined - set(protocol.__all__)))
        assert all(getattr(protocol, name) is getattr(module, name) for name in defined), room
        exported += sorted(defined)
    assert sorted(exported) == sorted(protocol.__all__)  # each name once, and nothing but the rooms' names


def test_engine_event_kinds_are_the_dataclasses_kinds_each_written_once() -> None:
    classes = typing.get_args(protocol.EngineEvent)
    assert tuple(cls.KIND for cls in classes) == protocol.ENGINE_EVENT_KINDS
    assert len(set(protocol.ENGINE_EVENT_KINDS)) == len(classes)
    assert dict(zip(protocol.ENGINE_EVENT_KINDS, classes, strict=True)) == protocol.ENGINE_EVENT_TYPES


@pytest.mark.parametrize(
    "ev",
    [
        protocol.StepEvent(step=3, thread="drafter0", loss=[1.5, None], ms={"fwd": 2.0}, t=10.0, rank=1, node=0),
        protocol.StageEvent(stage="distributed", pid=42, local_rank=1, local_world_size=2, world_size=4, t=1.0),
        protocol.ThreadErrorEvent(thread="drafter0", exc_type="RuntimeError", message="boom", t=2.0),
        protocol.RunEndEvent(ok=False, reason="a thread died", step=7),
        protocol.EvalEvent(thread="eval", step=5, tau=2.5, k=3, per_position=[0.9, 0.5, None]),
    ],
)
def test_an_engine_event_round_trips_through_a_line_of_events_jsonl(ev: protocol.EngineEvent) -> None:
    line = json.dumps(protocol.encode_engine_event(ev))
    doc = json.loads(line)
    assert doc["kind"] == ev.KIND
    assert ("rank" in doc) == (ev.rank is not None)  # a tag is written only when set
    assert protocol.decode_engine_event(doc) == ev
