"""Property-based fuzzing (hypothesis, 10,000 cases each): the agent's command dispatch and the log follower.

* The agent: junk lines (malformed JSON, wrong types, invalid UTF-8, NUL bytes, unknown commands, junk
  arguments to real commands) fed into a real ``Agent``'s ``dispatch``: each is answered with exactly one
  visible event (a counted ``error`` or a ``reply`` carrying its id) and the agent keeps serving. A real agent
  subprocess gets the nastiest of them (a 17 MB line included) over its stdin and still answers a ping.
* The log follower: generated sequences of appends (invalid UTF-8, NUL bytes, huge lines), truncations,
  rotations, removals and resumes from arbitrary (offset, inode) positions; the events, sent through a real
  JSON line each, rebuild every followed file byte for byte, with no crash and no endless poll.
"""

from __future__ import annotations

import io
import json
import os
import random
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.agent import REPO_ROOT, agent_argv, checkout_env

from engine import protocol
from engine.agent.follow import LogFollower
from engine.agent.main import build_agent
from engine.agent.server import Agent

FUZZ_CASES = 10_000
FUZZ = settings(
    max_examples=FUZZ_CASES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    database=None,
)

# Commands safe to run with junk arguments on any machine (none starts, stops or signals anything).
SAFE_REAL_COMMANDS = ("ping", "tail", "sim", "wait", "unsubscribe", "stacks")

# Hypothesis costs ~1 ms per case on a loaded 2-core box whatever it draws, and ~5 ms for nested strategies:
# each case draws one seed and expands it with random.Random, so 10,000 cases fit in seconds.
SEEDS = st.integers(0, 2**64 - 1)
_NASTY_TEXT = ["", "é", "\u0000", "\ud800", "'; touch /tmp/x; '", "$(id)", "\n", "‮", "a" * 300]


def _json_value(rnd: random.Random, depth: int = 0) -> Any:
    kind = rnd.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.random() < 0.5
    if kind == 2:
        return rnd.choice([0, -1, 1, 2**63, -(2**70), rnd.randrange(-(10**9), 10**9)])
    if kind == 3:
        return rnd.choice([0.5, -1e308, 1e-320, float("inf"), float("nan"), rnd.random()])
    if kind in (4, 5):
        return rnd.choice(_NASTY_TEXT) + rnd.randbytes(rnd.randrange(8)).decode("latin-1")
    if kind in (6, 7):
        return [_json_value(rnd, depth + 1) for _ in range(rnd.randrange(4))]
    return {
        rnd.choice(["id", "cmd", "args", "n", "x", ""]): _json_value(rnd, depth + 1) for _ in range(rnd.randrange(4))
    }


# Values json.loads cannot turn into protocol values: an integer over the 4300-digit limit (ValueError), floats out
# of range and the non-finite constants, nesting past the recursion limit (RecursionError, though well formed), lone
# surrogates and invalid UTF-8 in strings.
_UNDECODABLE = [
    b"1" * 5000,
    b"-" + b"9" * 4301,
    b"1e999",
    b"-1e400",
    b"1" * 400 + b".5e99999",
    b"NaN",
    b"Infinity",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    b'"\\ud800"',
    b'"\xed\xa0\x80"',
    b'"\xff\xfe"',
]


def junk_line(seed: int) -> bytes:
    """One generated command line: from random bytes to real commands with junk arguments."""
    rnd = random.Random(seed)
    kind = rnd.randrange(9)
    if kind == 8:  # what Python's json refuses with something other than JSONDecodeError, inside a real command
        return b'{"id": %d, "cmd": "ping", "args": {"x": %s}}' % (rnd.randrange(2**40), rnd.choice(_UNDECODABLE))
    if kind == 0:
        return rnd.randbytes(rnd.randrange(200)).replace(b"\n", b" ")  # invalid UTF-8, NUL bytes, anything
    if kind == 1:
        return json.dumps(_json_value(rnd)).encode()  # valid JSON of any shape
    if kind == 2:
        obj = {"id": _json_value(rnd, 3), "cmd": _json_value(rnd, 3), "args": _json_value(rnd)}
        return json.dumps(obj).encode()
    if kind == 3:  # an unknown command, well formed
        name = rnd.choice(["", "pingx", "PING", "launch ", "../x", "\u0000"]) + str(rnd.randrange(100))
        return json.dumps({"id": rnd.randrange(2**40), "cmd": name, "args": {}}).encode()
    if kind in (4, 5):  # a real, harmless command with junk arguments
        args = {
            rnd.choice(["n", "run_id", "milestone", "timeout_s", "gpu", "util_pct", "x"]): _json_value(rnd)
            for _ in range(rnd.randrange(4))
        }
        obj = {"id": rnd.randrange(2**40), "cmd": rnd.choice(SAFE_REAL_COMMANDS), "args": args}
        return json.dumps(obj).encode()
    if kind == 6:  # a valid command line with NUL / invalid bytes spliced in
        good = json.dumps({"id": 1, "cmd": "ping", "args": {}}).encode()
        at = rnd.randrange(len(good) + 1)
        return good[:at] + rnd.choice([b"\x00", b"\xff", b"\xc3", b"\xed\xa0\x80", b"\r"]) + good[at:]
    return rnd.choice([b"{", b"[", b'{"a":']) * rnd.randrange(1, 5000)  # deep nesting / unterminated


class _Sink(io.RawIOBase):
    """The agent's stdout: collects event lines, thread-safe."""

    def __init__(self) -> None:
        self.lines: list[bytes] = []
        self._buf = b""
        self.cond = threading.Condition()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = bytes(b)
        with self.cond:
            self._buf += data
            *done, self._buf = self._buf.split(b"\n")
            self.lines.extend(done)
            self.cond.notify_all()
        return len(data)

    def wait_count(self, n: int, timeout_s: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.lines) >= n, timeout_s)


@pytest.fixture(scope="module")
def fuzz_agent(tmp_path_factory: pytest.TempPathFactory) -> tuple[Agent, _Sink]:
    sink = _Sink()
    root = tmp_path_factory.mktemp("fuzz-run-root")
    agent = build_agent(root, simulate_gpus=2, out=sink)  # type: ignore[arg-type]
    return agent, sink


def test_agent_dispatch_answers_every_junk_line_visibly_and_keeps_serving(
    fuzz_agent: tuple[Agent, _Sink],
) -> None:
    agent, sink = fuzz_agent
    seen = {"cases": 0, "errors": 0, "replies": 0, "silent_blank": 0}

    @FUZZ
    @given(seed=SEEDS)
    def one(seed: int) -> None:
        line = junk_line(seed)
        seen["cases"] += 1
        before_lines, before_bad = len(sink.lines), agent.bad_lines
        agent.dispatch(line)
        if not line.strip():
            seen["silent_blank"] += 1
            assert len(sink.lines) == before_lines and agent.bad_lines == before_bad
            return
        assert sink.wait_count(before_lines + 1, 10.0), f"no answer to {line[:80]!r}"
        ev = protocol.parse_event(sink.lines[before_lines])
        if ev["ev"] == "error":
            seen["errors"] += 1
            assert agent.bad_lines == before_bad + 1
            assert ev["message"].startswith(f"bad command line #{agent.bad_lines}:"), ev
        else:
            seen["replies"] += 1
            assert ev["ev"] == "reply", ev
            cmd_id, _cmd, _ = protocol.parse_command(line)
            assert ev["id"] == cmd_id
            assert isinstance(ev["ok"], bool)
            if not ev["ok"]:
                assert isinstance(ev["error"], str) and ev["error"], ev
        # Exactly one answer (give a late duplicate a moment to show).
        assert not sink.wait_count(before_lines + 2, 0.0)

    one()
    assert not agent.stopping.is_set()
    # Still serving: a ping is answered.
    n = len(sink.lines)
    agent.dispatch(json.dumps({"id": 424242, "cmd": "ping", "args": {}}).encode())
    assert sink.wait_count(n + 1, 10.0)
    last = protocol.parse_event(sink.lines[n])
    assert last["ev"] == "reply" and last["id"] == 424242 and last["ok"] is True
    assert seen["cases"] >= FUZZ_CASES and seen["errors"] > 100 and seen["replies"] > 100
    print(f"\n[adversarial] agent dispatch fuzz: {seen}; bad lines counted by the agent: {agent.bad_lines}")


EVENT_KINDS = ("hello", "gpus", "procs", "log", "log_reset", "engine", "run", "anomalies", "milestone", "reply",
               "warning", "error", "progress", "zzz")  # fmt: skip


def junk_event_line(seed: int) -> bytes:
    """One generated agent line: a real event kind with junk fields, or a value json cannot make a protocol value."""
    rnd = random.Random(seed)
    kind = rnd.randrange(4)
    if kind == 0:
        field = rnd.choice(["offset", "inode", "id", "t", "gpus", "run", "message", "event", "data"])
        return b'{"ev": "%s", "%s": %s}' % (rnd.choice(EVENT_KINDS).encode(), field.encode(), rnd.choice(_UNDECODABLE))
    if kind == 1:
        return junk_line(seed)  # the agent's junk, read as an event line
    obj = {"ev": rnd.choice(EVENT_KINDS)}
    fields = ["id", "ok", "result", "error", "offset", "inode", "data", "event", "run", "gpus", "items", "message"]
    obj.update({rnd.choice(fields): _json_value(rnd) for _ in range(rnd.randrange(6))})
    return json.dumps(obj).encode()


def test_client_decoding_turns_every_junk_event_line_into_an_event_or_an_undecodable(tmp_path: Path) -> None:
    """The client's side of the wire: each line is a ProtocolError (the session warns and reads on) or a dict that
    decodes to an event or an Undecodable; nothing else is raised, and every string it holds prints on a terminal."""
    from tui.hosttext import printable_lines
    from tui.link.events import Undecodable, decode

    seen = {"cases": 0, "unreadable": 0, "undecodable": 0, "events": 0}

    @FUZZ
    @given(seed=SEEDS)
    def one(seed: int) -> None:
        line = junk_event_line(seed)
        seen["cases"] += 1
        try:
            obj = protocol.parse_event(line)
        except protocol.ProtocolError:
            seen["unreadable"] += 1
            return
        ev = decode(obj)
        if isinstance(ev, Undecodable):
            seen["undecodable"] += 1
            printable_lines(ev.message).encode("utf-8")  # a lone surrogate in it cannot break the terminal write
        else:
            seen["events"] += 1
            printable_lines(repr(ev)).encode("utf-8")

    one()
    assert seen["cases"] >= FUZZ_CASES and seen["unreadable"] > 100 and seen["undecodable"] > 100
    print(f"\n[adversarial] client event decoding fuzz: {seen}")


def test_a_5000_digit_integer_gets_the_real_agent_an_error_and_the_next_ping_answers(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        agent_argv(tmp_path / "root"), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=checkout_env(), cwd=REPO_ROOT
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert protocol.parse_event(proc.stdout.readline())["ev"] == "hello"
        proc.stdin.write(b'{"id": 1, "cmd": "ping", "args": {"n": ' + b"7" * 5000 + b"}}\n")
        proc.stdin.write(b'{"id": 2, "cmd": "ping", "args": {}}\n')
        proc.stdin.flush()
        first = protocol.parse_event(proc.stdout.readline())
        assert first["ev"] == "error" and "4300 digits" in first["message"], first
        second = protocol.parse_event(proc.stdout.readline())
        assert second["ev"] == "reply" and second["id"] == 2 and second["ok"] is True, second
        assert proc.poll() is None
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_real_agent_subprocess_survives_a_stream_of_junk_and_counts_it(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        agent_argv(tmp_path, "--simulate-gpus", "1"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=checkout_env(),
        cwd=REPO_ROOT,
    )
    junk = [
        b"not json",
        b"\xff\xfe\x00\x00",
        b"\x00" * 1000,
        b'{"id": 1, "cmd": 5}',
        b'{"id": "x", "cmd": "ping"}',
        b'{"id": 2, "cmd": "ping", "args": []}',
        b"[" * 100_000,
        b'{"id": 3, "cmd": "ping"' + b" " * (17 * 1024 * 1024) + b"}",  # over the 16 MB line limit
        b'{"id": 4, "cmd": "no-such-command", "args": {}}',
        b'{"id": 5, "cmd": "tail", "args": {"n": "all"}}',
        b'{"id": 6, "cmd": "ping", "args": {}}',
    ]
    out, err = proc.communicate(b"\n".join(junk) + b"\n", timeout=120)
    assert proc.returncode == 0, err.decode()[-2000:]
    events = [protocol.parse_event(line) for line in out.splitlines()]
    assert events[0]["ev"] == "hello"
    errors = [e["message"] for e in events if e["ev"] == "error"]
    replies = {e["id"]: e for e in events if e["ev"] == "reply"}
    assert len(errors) == 8, errors  # 7 malformed lines and the over-long one, each said out loud
    assert any("over" in m and "bytes" in m for m in errors)
    assert [int(m.split("#")[1].split(":")[0]) for m in errors if m.startswith("bad command line #")] == [
        1,
        2,
        3,
        4,
        5,
        6,
        7,
    ]
    assert replies[4]["ok"] is False and "unknown command" in replies[4]["error"]
    assert replies[5]["ok"] is False and "n must be" in replies[5]["error"]
    assert replies[6]["ok"] is True  # and it was still serving after all that


# -- the log follower ---------------------------------------------------------------------------------------


def _payload(rnd: random.Random) -> bytes:
    kind = rnd.randrange(6)
    if kind == 0:
        return rnd.randbytes(rnd.randrange(1, 65))  # invalid UTF-8, NUL bytes, anything
    if kind == 1:
        return rnd.choice(
            [b"\x00\x00\n", b"\xff\xfe\xfd\n", b"\xe2\x82", b"\xac\n", b"\xf0\x9f\x98\x80", "é\n".encode()]
        )
    if kind == 2:
        return b"x" * rnd.randrange(1, 40_000) + b"\n"  # a huge line, many chunks long
    if kind == 3:
        return "€".encode() * rnd.randrange(1, 3000)  # multi-byte characters across chunk cuts
    return b"line %d\n" % rnd.randrange(10**6)


def gen_ops(seed: int) -> list[tuple[str, Any]]:
    """A generated sequence of what can happen to a followed file."""
    rnd = random.Random(seed)
    out: list[tuple[str, Any]] = []
    for _ in range(rnd.randrange(15)):
        op = rnd.choices(
            ["append", "poll", "truncate", "rotate", "remove_recreate", "resume"], weights=[6, 3, 1, 1, 1, 1]
        )[0]
        if op == "append":
            out.append((op, _payload(rnd)))
        elif op == "truncate":
            out.append((op, rnd.random()))
        elif op == "resume":
            out.append((op, (rnd.choice([-5, 0, 1, rnd.randrange(10**6), rnd.randrange(100)]), rnd.random() < 0.7)))
        else:
            out.append((op, None))
    return out


class _Model:
    """The client's side: rebuilds every followed file from the wire events."""

    def __init__(self) -> None:
        self.files: dict[int, bytearray] = {}
        self.inode: int | None = None
        self.resets = 0

    def feed(self, events: list[dict[str, Any]]) -> None:
        for raw in events:
            ev = protocol.parse_event(protocol.encode(raw))  # through a real wire line
            if ev["ev"] == "log_reset":
                self.resets += 1
                self.inode = ev["inode"]
                buf = self.files.setdefault(ev["inode"], bytearray())
                assert ev["offset"] <= len(buf) or ev["offset"] == 0, ev
                del buf[ev["offset"] :]
            else:
                assert ev["ev"] == "log", ev
                buf = self.files.setdefault(ev["inode"], bytearray())
                assert ev["offset"] == len(buf), f"gap or overlap: event at {ev['offset']}, have {len(buf)}"
                buf.extend(protocol.decode_log_data(ev["data"]))
                self.inode = ev["inode"]


def _drain(fol: LogFollower, model: _Model, total_bytes: int) -> None:
    # Each poll moves at least one byte or ends the burst: more polls than bytes would be a hang.
    for _ in range(total_bytes // fol.chunk_bytes + 8):
        model.feed(fol.poll())
        if not fol.more:
            return
    raise AssertionError("the follower kept saying 'more' without finishing")


def test_log_follower_rebuilds_every_file_byte_for_byte_under_generated_abuse(tmp_path: Path) -> None:
    counter = {"cases": 0, "bytes": 0, "resets": 0}

    @FUZZ
    @given(seed=SEEDS)
    def one(seed: int) -> None:
        seq = gen_ops(seed)
        counter["cases"] += 1
        d = tmp_path / f"case{counter['cases']}"
        d.mkdir()
        path = d / "output.log"
        path.write_bytes(b"")
        kept: dict[int, Path] = {}  # inode -> the path where that file's final bytes are
        kept[path.stat().st_ino] = path
        written = 0
        fol = LogFollower(path, chunk_bytes=4096, poll_bytes=16384)
        model = _Model()
        try:
            for i, (op, arg) in enumerate(seq):
                if op == "append":
                    with open(path, "ab") as fh:
                        fh.write(arg)
                    written += len(arg)
                elif op == "poll":
                    _drain(fol, model, written)
                elif op == "truncate":
                    size = path.stat().st_size
                    os.truncate(path, int(size * arg))
                    _drain(fol, model, written)  # a truncation must be seen before the file regrows
                elif op == "rotate":
                    _drain(fol, model, written)
                    old = d / f"output.log.{i}"
                    os.rename(path, old)
                    kept[old.stat().st_ino] = old
                    path.write_bytes(b"")
                    kept[path.stat().st_ino] = path
                    _drain(fol, model, written)  # one rotation at a time: a path follower cannot see a skipped file
                elif op == "remove_recreate":
                    _drain(fol, model, written)
                    ino = path.stat().st_ino
                    data = path.read_bytes()
                    path.unlink()
                    gone = d / f"removed.{i}"
                    gone.write_bytes(data)  # what the removed file held, for the comparison
                    kept[ino] = gone
                    _drain(fol, model, written)  # the follower keeps the old descriptor meanwhile
                    path.write_bytes(b"")
                    kept[path.stat().st_ino] = path
                    _drain(fol, model, written)
                elif op == "resume":
                    # A client (re)subscribing from where it says it is: possibly a foreign inode, past the end,
                    # or negative; the follower either continues exactly or says it restarts.
                    _drain(fol, model, written)
                    offset, same_inode = arg
                    cur = path.stat().st_ino
                    have = model.files.get(cur, bytearray())
                    offset = min(offset, len(have)) if same_inode and offset >= 0 else offset
                    fol.close()
                    fol = LogFollower(path, offset=offset, inode=cur if same_inode else cur + 10**9, chunk_bytes=4096)
                    model.files[cur] = bytearray(have[: max(offset, 0)]) if same_inode else bytearray(have)
                    before = model.resets
                    _drain(fol, model, written)
                    if not same_inode:
                        assert model.resets == before + 1  # a foreign inode is never continued silently
            _drain(fol, model, written)
        finally:
            fol.close()
        cur = path.stat().st_ino
        assert bytes(model.files.get(cur, b"")) == path.read_bytes()
        for ino, buf in model.files.items():
            if ino in kept and ino != cur:
                assert bytes(buf) == kept[ino].read_bytes(), f"rotated-away file {kept[ino].name} differs"
        counter["bytes"] += written
        counter["resets"] += model.resets
        shutil.rmtree(d)

    one()
    assert counter["cases"] >= FUZZ_CASES
    print(f"\n[adversarial] log follower fuzz: {counter}")


def test_fuzz_budget_is_ten_thousand_cases() -> None:
    assert FUZZ.max_examples >= 10_000
    assert time.monotonic() > 0
