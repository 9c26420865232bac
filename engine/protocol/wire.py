"""The wire: JSON lines between the host agent and its clients, and the one error a bad line becomes.

Wire format: JSON lines, UTF-8, one object per line.

* agent -> client, on the agent's stdout: events, ``{"ev": <kind>, ...}`` (engine/protocol/agent_events.py).
* client -> agent, on the agent's stdin: commands, ``{"id": <int>, "cmd": <name>, "args": {...}}``.
  Every command gets exactly one ``reply`` event with the same ``id`` (engine/protocol/replies.py).

Bytes of a log are carried losslessly: the agent decodes them as UTF-8 with
``surrogateescape`` and ``json.dumps`` escapes the lone surrogates, so
``decode_log_data(encode_log_data(b)) == b`` for any bytes ``b``.

The first line an agent prints is always a ``hello`` event, carrying ``PROTOCOL_VERSION``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import Any

PROTOCOL_VERSION = 1
AGENT_VERSION = "0.1.0"


class ProtocolError(ValueError):
    """A line that is not a valid protocol message."""


def to_jsonable(obj: Any) -> Any:
    """Dataclasses to dicts; non-finite floats to None (JSON has no NaN)."""
    if hasattr(obj, "__dataclass_fields__"):
        obj = asdict(obj)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def encode(msg: dict[str, Any]) -> bytes:
    """One protocol line, newline included."""
    return (json.dumps(to_jsonable(msg), separators=(",", ":"), ensure_ascii=True) + "\n").encode("ascii")


def event(ev: str, **fields: Any) -> dict[str, Any]:
    return {"ev": ev, **fields}


def command(cmd_id: int, cmd: str, **args: Any) -> dict[str, Any]:
    return {"id": cmd_id, "cmd": cmd, "args": args}


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a protocol value")  # encode() never writes NaN or Infinity


def decode(line: bytes | str) -> dict[str, Any]:
    """Parse one protocol line; raises ProtocolError for anything that is not a JSON object.

    Every way a line can fail to decode ends here as a ProtocolError, never as another exception: invalid UTF-8,
    malformed JSON, an integer over Python's digit limit (a ValueError), a float out of range, nesting deep
    enough to exhaust the stack (RecursionError), or a line too large for memory."""
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        obj = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except (ValueError, RecursionError, MemoryError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ProtocolError(f"not a JSON line: {str(exc)[:200]}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def parse_command(line: bytes | str) -> tuple[int | None, str, dict[str, Any]]:
    """Validate a command line: returns (id, cmd, args) or raises ProtocolError."""
    obj = decode(line)
    cmd_id = obj.get("id")
    if cmd_id is not None and (not isinstance(cmd_id, int) or isinstance(cmd_id, bool)):
        raise ProtocolError("command id must be an integer")
    cmd = obj.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise ProtocolError("command has no 'cmd' string")
    args = obj.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError("command 'args' must be an object")
    return cmd_id, cmd, args


def parse_event(line: bytes | str) -> dict[str, Any]:
    """Validate an event line: returns the object or raises ProtocolError."""
    obj = decode(line)
    if not isinstance(obj.get("ev"), str):
        raise ProtocolError("event has no 'ev' string")
    return obj


def encode_log_data(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def decode_log_data(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")
