"""The client's side of the protocol under junk: a hostile stand-in agent (started by the real LocalTransport in
place of the interpreter) sends a valid hello, then 10,000 generated lines (malformed JSON, invalid UTF-8, NUL
bytes, non-objects, unknown event types, replies to no command or with unhashable ids, log events with wrong
types and out-of-order offsets, a 5 MB line), then answers a ping. The real Session must stay connected, say
every unreadable line out loud (one warning each) and still get its reply."""

from __future__ import annotations

import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

from support.waiting import wait_until_async

from engine import protocol
from tui.link.events import ConnectionEvent, Undecodable
from tui.link.session import ConnectOptions, Session, open_session

JUNK_LINES = 10_000

HOSTILE = r"""#!{python}
import json, sys
out = sys.stdout.buffer
out.write(json.dumps({{"ev": "hello", "protocol": {protocol}, "agent_version": "hostile", "hostname": "h",
                      "pid": 1, "python": "3", "capabilities": {{}}}}).encode() + b"\n")
with open({junk!r}, "rb") as fh:
    out.write(fh.read())
out.flush()
for line in sys.stdin.buffer:
    try:
        cmd = json.loads(line)
    except ValueError:
        continue
    reply = {{"ev": "reply", "id": cmd.get("id"), "ok": True, "result": {{"t": 1.0}}, "error": None}}
    out.write(json.dumps(reply).encode() + b"\n")
    out.flush()
"""


def _junk(rnd: random.Random) -> bytes:
    kind = rnd.randrange(10)
    if kind == 0:
        return rnd.randbytes(rnd.randrange(1, 120)).replace(b"\n", b" ")
    if kind == 1:
        return json.dumps(rnd.choice([None, 1, "x", [1, 2], 3.5, True])).encode()
    if kind == 2:
        return json.dumps({"ev": rnd.choice(["zzz", "", "HELLO", "log2", "reply "]), "x": rnd.random()}).encode()
    if kind == 3:
        return json.dumps(
            {"ev": "reply", "id": rnd.choice([10**9, -1, None, "7", [1], {"a": 1}, 1.5]), "ok": 7}
        ).encode()
    if kind == 4:
        off = rnd.choice([-5, 0, 10**15, "3", None, 2.5])
        return json.dumps(
            {"ev": "log", "offset": off, "inode": rnd.choice([1, "i", None]), "data": rnd.choice(["a", 5, None])}
        ).encode()
    if kind == 5:
        return json.dumps(
            {"ev": "log_reset", "offset": rnd.choice([0, -1, "z"]), "inode": rnd.choice([[1], 2])}
        ).encode()
    if kind == 6:
        return json.dumps({"ev": "engine", "offset": rnd.choice([1, "x", None]), "event": rnd.choice([{}, 3])}).encode()
    if kind == 7:
        good = b'{"ev":"gpus","gpus":[]}'
        at = rnd.randrange(len(good) + 1)
        return good[:at] + rnd.choice([b"\x00", b"\xff", b"\xc3"]) + good[at:]
    if kind == 8:
        return json.dumps(
            {"ev": rnd.choice(["connection", "warning", "error", "run", "anomalies"]), "junk": [1]}
        ).encode()
    return rnd.choice([b"{", b"[", b'{"ev":']) * rnd.randrange(1, 3000)


def _hostile_session(tmp_path: Path, lines: list[bytes]) -> Session:
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b"\n".join(lines) + b"\n")
    fake = tmp_path / "hostile-agent"
    fake.write_text(HOSTILE.format(python=sys.executable, protocol=protocol.PROTOCOL_VERSION, junk=str(junk)))
    fake.chmod(0o755)
    return open_session("local", ConnectOptions(python=str(fake), run_root=str(tmp_path), connect_timeout_s=5.0))


async def test_session_survives_a_hostile_agent_and_reports_every_unreadable_line(tmp_path: Path) -> None:
    rnd = random.Random(6)
    lines = [_junk(rnd) for _ in range(JUNK_LINES)]
    lines.insert(5000, b'{"ev": "log", "offset": 0, "inode": 1, "data": "' + b"x" * (5 * 1024 * 1024) + b'"}')
    lines = [line for line in lines if line.strip()]
    unreadable = 0
    for line in lines:
        try:
            protocol.parse_event(line)
        except protocol.ProtocolError:
            unreadable += 1
    session = _hostile_session(tmp_path, lines)
    warnings: list[str] = []
    states: list[str] = []
    loop_errors: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: loop_errors.append(ctx))
    session.add_event_listener(
        lambda ev: warnings.append(ev.message) if isinstance(ev, (protocol.WarningEvent, Undecodable)) else None
    )
    session.add_event_listener(lambda ev: states.append(ev.state) if isinstance(ev, ConnectionEvent) else None)
    await session.connect()
    try:
        await wait_until_async(
            lambda: sum(w.startswith("unreadable line") for w in warnings) >= unreadable,
            60,
            f"{unreadable} unreadable-line warnings",
            observe=lambda: sum(w.startswith("unreadable line") for w in warnings),
            interval_s=0.05,
        )
        reply = await session.request("ping", timeout_s=30.0)
        assert reply == {"t": 1.0}
        assert session.state == "connected"
    finally:
        await session.close()
    assert states[:2] == ["connecting", "connected"] and "reconnecting" not in states, states
    unreadable_warnings = [w for w in warnings if w.startswith("unreadable line from the agent")]
    assert len(unreadable_warnings) == unreadable, (len(unreadable_warnings), unreadable)
    assert not loop_errors, loop_errors[:3]
    print(
        f"\n[adversarial] hostile agent: {len(lines)} junk lines, {unreadable} unreadable, each warned; still connected"
    )


async def test_an_agent_cannot_spoof_the_sessions_connection_state(tmp_path: Path) -> None:
    spoof = json.dumps({"ev": "connection", "state": "failed", "detail": "spoofed by the agent", "attempt": 0})
    session = _hostile_session(tmp_path, [spoof.encode()])
    seen: list[tuple[str, str]] = []
    session.add_event_listener(
        lambda ev: seen.append((ev.state, session.state)) if isinstance(ev, ConnectionEvent) else None
    )
    await session.connect()
    try:
        await session.request("ping", timeout_s=30.0)
    finally:
        await session.close()
    assert all(told == actual for told, actual in seen), seen


async def test_a_reply_with_an_unhashable_id_does_not_kill_the_sessions_reader(tmp_path: Path) -> None:
    session = _hostile_session(tmp_path, [b'{"ev": "reply", "id": [1], "ok": true, "result": {}}'])
    await session.connect()
    try:
        assert await session.request("ping", timeout_s=3.0) == {"t": 1.0}
    finally:
        await session.close()
        reader = session._reader
        if reader is not None and reader.done() and not reader.cancelled():
            reader.exception()  # retrieved here, not logged by a finalizer in the middle of a later test
