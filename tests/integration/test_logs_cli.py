"""`specdec-tui logs`: what reaches stdout is the run's output.log, byte for byte, whatever the reader does.

Real parts: the OpenSSH sshd on 127.0.0.1 (conftest), the shipped agent, the supervisor's wrapper in the
private tmux server, and the ``specdec-tui`` client as a subprocess whose stdout is a pipe this test reads.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.agent import checkout_env
from support.waiting import wait_until

from engine.supervisor import records

F_GETPIPE_SZ = 1032  # fcntl.F_GETPIPE_SZ, named only from Python 3.10 on some platforms

# Writes "start", waits for the go file, then numbered lines at about RATE lines/s until the stop file exists.
WRITER = r"""
import os, sys, time
go, stop, rate = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = sys.stdout.buffer
out.write(b"start\n"); out.flush()
while not os.path.exists(go):
    time.sleep(0.01)
i, t0 = 0, time.monotonic()
while not os.path.exists(stop):
    due = int((time.monotonic() - t0) * rate)
    if i < due:
        out.write(b"".join(b"line %09d of the numbered run output\n" % k for k in range(i, due)))
        out.flush()
        i = due
    else:
        time.sleep(0.005)
out.write(b"done %d\n" % i); out.flush()
"""
LINE_BYTES = len(b"line 000000000 of the numbered run output")
RATE_LINES_S = 20_000  # 0.8 MB/s, twice what the slow reader takes
SLOW_READ_BYTES = 4096  # per poll (10 ms): 0.4 MB/s


def _children_of(ppid: int) -> set[int]:
    kids: set[int] = set()
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            raw = Path(f"/proc/{name}/stat").read_bytes()
        except OSError:
            continue
        fields = raw[raw.rindex(b")") + 2 :].split()
        if int(fields[1]) == ppid and fields[0] not in (b"Z", b"X"):
            kids.add(int(name))
    return kids


def _session_process(monitor: int) -> int:
    """The sshd process holding the connection's socket: the monitor's sshd child (privilege separation)."""
    for kid in _children_of(monitor):
        if Path(f"/proc/{kid}/comm").read_text().startswith("sshd"):
            return kid
    return monitor


def _pending_bytes(fd: int) -> int:
    buf = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, buf)
    return int.from_bytes(buf, sys.byteorder)


def _read(fd: int, into: bytearray, most: int) -> None:
    """Whatever is there, up to ``most`` bytes, without waiting (the caller's poll interval paces it)."""
    if select.select([fd], [], [], 0)[0]:
        into += os.read(fd, most)


KILLS = 4
READ_POLL_S = 0.01  # each look reads at most SLOW_READ_BYTES: this interval sets the slow reader's pace
QUIET_S = 5.0  # no byte for this long after the run ended: the follower has sent all it will


@pytest.mark.ssh
@pytest.mark.tmux
def test_follow_into_a_slow_pipe_loses_nothing_when_the_ssh_link_drops_while_the_pipe_is_full(
    sshd: Any, cli: Callable[..., Any], run_root: Path, tmp_path: Path
) -> None:
    go, stop = tmp_path / "go", tmp_path / "stop"
    r = cli(
        "launch", sshd.target, *sshd.args(), "--run-root", str(run_root), "--wait", "output", "--json",
        "--", sys.executable, "-c", WRITER, str(go), str(stop), str(RATE_LINES_S),
    )  # fmt: skip
    assert r.returncode == 0, r.output
    run_dir = records.run_dir_for(run_root, json.loads(r.stdout)["run_id"])
    main_sshd = int((sshd.dir / "sshd.pid").read_text().split()[0])
    before = _children_of(main_sshd)
    fd, write_end = os.pipe()
    # The pipe's write end is non-blocking, as when another process sharing it set O_NONBLOCK (ssh, node and
    # event loops do): a full pipe then answers EAGAIN, which the client must take as "wait".
    os.set_blocking(write_end, False)
    follow = subprocess.Popen(
        [sys.executable, "-m", "tui", "logs", sshd.target, *sshd.args(), "--run-root", str(run_root), "-n", "1", "-f"],
        stdout=write_end,
        stderr=subprocess.PIPE,
        env=checkout_env(),
    )
    os.close(write_end)
    pipe_bytes = fcntl.fcntl(fd, F_GETPIPE_SZ)
    got = bytearray()
    try:
        # unbuffered: every byte is counted
        got += wait_until(lambda: os.read(fd, 6), 30, "the tail's one line", interval_s=READ_POLL_S)
        assert got == b"start\n"
        go.write_text("")
        served_by: set[int] = set()
        for _ in range(KILLS):
            # A new SSH session serves the follower (the first one, or the one after the last kill).
            old = before | served_by
            new = wait_until(
                lambda o=old: _read(fd, got, 1 << 20) or _children_of(main_sshd) - o,
                60,
                "a session",
                interval_s=READ_POLL_S,
            )
            assert len(new) == 1, new
            served_by |= new
            # The reader falls behind: the pipe fills and the client waits on it while the link keeps carrying.
            wait_until(
                lambda: _read(fd, got, SLOW_READ_BYTES) or _pending_bytes(fd) > pipe_bytes // 2,
                30,
                "a full pipe",
                interval_s=READ_POLL_S,
            )
            for _ in range(30):
                _read(fd, got, SLOW_READ_BYTES)
                time.sleep(0.01)
            os.kill(_session_process(min(new)), signal.SIGKILL)  # the session's sshd dies: the connection is cut
        stop.write_text("")
        wait_until(
            lambda: _read(fd, got, 1 << 20) or (run_dir / records.EXIT_JSON).exists(),
            30,
            "the writer's exit",
            interval_s=READ_POLL_S,
        )
        size = (run_dir / records.OUTPUT_LOG).stat().st_size
        while len(got) < size and select.select([fd], [], [], QUIET_S)[0]:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            got += chunk
    finally:
        stop.write_text("")
        follow.send_signal(signal.SIGTERM)
        follow.wait(10)
        os.close(fd)
    assert follow.stderr is not None
    notes = follow.stderr.read().decode(errors="replace")
    assert notes.count("[reconnected") >= KILLS, notes
    data = (run_dir / records.OUTPUT_LOG).read_bytes()
    numbered = [ln for ln in bytes(got).split(b"\n") if ln.startswith(b"line ")]
    spliced = [ln for ln in numbered if len(ln) != LINE_BYTES]
    numbers = [int(ln.split()[1]) for ln in numbered if len(ln) == LINE_BYTES]
    lost = numbers[-1] + 1 - len(numbers) if numbers else None
    assert not spliced and lost == 0, f"{lost} lines lost, {len(spliced)} spliced: {spliced[:2]}"
    assert bytes(got) == data


def _read_at_least(fd: int, n: int, quiet_s: float = 5.0) -> bytes:
    """At least ``n`` bytes from ``fd``, or fewer if nothing comes for ``quiet_s``."""
    got = b""
    while len(got) < n and select.select([fd], [], [], quiet_s)[0]:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        got += chunk
    return got


def _hand_made_run(run_root: Path, run_id: str, log: bytes, current: bool = True) -> Path:
    """A finished run's directory as the supervisor leaves it, made by hand (only what `logs` reads)."""
    run_dir = records.run_dir_for(run_root, run_id)
    run_dir.mkdir(parents=True)
    (run_dir / records.OUTPUT_LOG).write_bytes(log)
    if current:
        records.set_current(run_root, run_dir)
    return run_dir


def test_logs_n_serves_every_line_asked_for_beyond_the_tail_reply_cap(cli: Callable[..., Any], run_root: Path) -> None:
    log = b"".join(b"line %06d\n" % i for i in range(40_000))
    _hand_made_run(run_root, "20261201-100000-aaaa", log)
    everything = cli("logs", "local", "--run-root", str(run_root), "-n", "100000000")
    assert everything.returncode == 0, everything.stderr
    assert everything.stdout.encode() == log  # all 40,000 lines, not the last 10,000
    last = cli("logs", "local", "--run-root", str(run_root), "-n", "25000")
    assert last.returncode == 0 and last.stdout.encode() == log[-25_000 * len(b"line 000000\n") :], last.stderr
    small = cli("logs", "local", "--run-root", str(run_root), "-n", "3")
    assert small.stdout == "line 039997\nline 039998\nline 039999\n"


def test_logs_n_then_follow_continues_right_after_the_last_line_printed(run_root: Path) -> None:
    log = b"".join(b"line %06d\n" % i for i in range(30_000)) + b"a partial li"
    run_dir = _hand_made_run(run_root, "20261201-100000-bbbb", log)
    argv = [sys.executable, "-m", "tui", "logs", "local", "--run-root", str(run_root), "-f"]
    for n in ("100000000", "2"):
        follow = subprocess.Popen([*argv, "-n", n], stdout=subprocess.PIPE, env=checkout_env())
        assert follow.stdout is not None
        try:
            want = log if n != "2" else b"a partial line, ended\na partial li"
            got = _read_at_least(follow.stdout.fileno(), len(want))
            with (run_dir / records.OUTPUT_LOG).open("ab") as f:
                f.write(b"ne, ended\n")  # the follower continues the partial line, no newline added
            want += b"ne, ended\n"
            got += _read_at_least(follow.stdout.fileno(), len(want) - len(got))
            assert got == want
            log += b"ne, ended\n" + b"a partial li"
            with (run_dir / records.OUTPUT_LOG).open("ab") as f:
                f.write(b"a partial li")
        finally:
            follow.terminate()
            follow.wait(10)


async def test_the_session_passes_on_each_log_byte_once_and_never_across_a_hole() -> None:
    from engine import protocol
    from tui.link.events import ClientEvent
    from tui.link.session import ConnectOptions, Session
    from tui.link.transport import LocalTransport, Target

    session = Session(LocalTransport(Target(local=True), ConnectOptions()), ConnectOptions())
    session.resume_from({"offset": 10, "inode": 7}, None)
    session._streams = {"gpu_interval_s": 1.0, "procs_interval_s": 1.0}  # as after start_streams
    asked: list[dict[str, Any]] = []

    async def subscribe() -> None:
        asked.append(dict(session.log_position or {}))

    session._subscribe = subscribe  # type: ignore[method-assign]
    seen: list[tuple[str, Any]] = []

    def on_event(ev: ClientEvent) -> None:
        if isinstance(ev, protocol.LogEvent):
            seen.append(("log", ev.offset))
        elif isinstance(ev, protocol.WarningEvent):
            seen.append(("warning", ev.message))
        else:
            seen.append((ev.EV, None))

    session.add_event_listener(on_event)

    def log(offset: int, data: bytes) -> None:
        session._on_event({"ev": "log", "offset": offset, "inode": 7, "data": protocol.encode_log_data(data)})

    log(10, b"abcde")  # continues: passed on
    log(12, b"cdefg")  # overlaps 3 bytes already passed on: only "fg" goes on, at 15
    log(13, b"de")  # all of it passed on already: dropped
    log(30, b"zz")  # a hole (17..30): dropped, and the streams are asked for again from byte 17
    log(40, b"zz")  # still the old stream: dropped, asked for once
    hole = "log bytes 17..30 missing from the stream; resuming from byte 17"
    assert seen == [("log", 10), ("log", 15), ("warning", hole)]
    assert session.log_position == {"offset": 17, "inode": 7}
    await asyncio.sleep(0)
    assert asked == [{"offset": 17, "inode": 7}]


def test_logs_n_serves_every_line_asked_for_when_long_lines_overrun_the_tail_window(
    cli: Callable[..., Any], run_root: Path
) -> None:
    line = lambda i: b"%06d " % i + b"y" * 8_000 + b"\n"  # noqa: E731 - 8 KB lines: 1,500 of them are 12 MB
    log = b"".join(line(i) for i in range(2_000))
    _hand_made_run(run_root, "20261201-100000-cccc", log)
    r = cli("logs", "local", "--run-root", str(run_root), "-n", "1500")
    assert r.returncode == 0, r.stderr
    assert r.stdout.encode() == b"".join(line(i) for i in range(500, 2_000))


# Numbered lines at once, then one more line each time the poke file appears, until the stop file exists.
BURST_WRITER = r"""
import os, sys, time
stop = sys.argv[1]
out = sys.stdout.buffer
out.write(b"".join(b"line %09d of the numbered run output\n" % k for k in range(5000))); out.flush()
while not os.path.exists(stop):
    time.sleep(0.01)
out.write(b"done\n"); out.flush()
"""


@pytest.mark.ssh
@pytest.mark.tmux
@pytest.mark.parametrize("drop_after_s", [0.3, 0.8, 1.5])
def test_follow_gets_every_line_when_the_ssh_link_drops_during_its_first_seconds(
    drop_after_s: float, sshd: Any, cli: Callable[..., Any], run_root: Path, tmp_path: Path
) -> None:
    stop = tmp_path / "stop"
    r = cli(
        "launch", sshd.target, *sshd.args(), "--run-root", str(run_root), "--wait", "output", "--json",
        "--", sys.executable, "-c", BURST_WRITER, str(stop),
    )  # fmt: skip
    assert r.returncode == 0, r.output
    run_dir = records.run_dir_for(run_root, json.loads(r.stdout)["run_id"])
    main_sshd = int((sshd.dir / "sshd.pid").read_text().split()[0])
    before = _children_of(main_sshd)
    t0 = time.monotonic()
    follow = subprocess.Popen(
        [sys.executable, "-m", "tui", "logs", sshd.target, *sshd.args(), "--run-root", str(run_root),
         "-n", "100000", "-f"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=checkout_env(),
    )  # fmt: skip
    assert follow.stdout is not None and follow.stderr is not None
    try:
        # The drop: at drop_after_s, or the moment the follower's first SSH session appears when that is later
        # (then the link dies while the agent starts: a drop during connect).
        time.sleep(drop_after_s)  # the drop's moment is the scenario, not a wait for something
        first = wait_until(lambda: _children_of(main_sshd) - before, 30, "the follower's SSH session", interval_s=0.005)
        dropped_at_s = time.monotonic() - t0
        for pid in first:
            os.kill(_session_process(pid), signal.SIGKILL)
        stop.write_text("")
        wait_until(lambda: (run_dir / records.EXIT_JSON).exists(), 30, "the writer's exit")
        data = (run_dir / records.OUTPUT_LOG).read_bytes()
        got = _read_at_least(follow.stdout.fileno(), len(data))
    finally:
        stop.write_text("")
        follow.send_signal(signal.SIGTERM)
        follow.wait(10)
    notes = follow.stderr.read().decode(errors="replace")
    print(f"\n[drop] link cut {dropped_at_s:.2f} s after `logs -f` started; its notes: {notes.strip()!r}")
    assert follow.returncode != 3, notes
    assert "[reconnecting: " in notes and "[reconnected after " in notes, notes
    assert got == data, f"{len(got)} of {len(data)} bytes; notes: {notes}"


@pytest.mark.tmux
def test_follow_ends_once_the_run_has_ended_and_its_last_lines_are_out(cli: Callable[..., Any], run_root: Path) -> None:
    """`logs -f` on the current run waited forever after the run ended (on another run it said so and exited), where
    `docker logs -f` and `kubectl logs -f` end with the container: every line, then one line on stderr, exit 0."""
    job = "echo first; sleep 3; echo last; printf 'no newline'"
    launched = cli("launch", "local", "--run-root", str(run_root), "--wait", "output", "--json", "--", "sh", "-c", job)
    assert launched.returncode == 0, launched.output
    run_id = json.loads(launched.stdout)["run_id"]
    follow = cli("logs", "local", "--run-root", str(run_root), "-f", timeout_s=45)
    assert follow.returncode == 0, follow.output
    assert follow.stdout.endswith("first\nlast\nno newline"), follow.stdout
    assert follow.stderr.splitlines()[-1] == f"[run {run_id} exited: nothing more to follow]", follow.stderr
    ended = cli("logs", "local", "--run-root", str(run_root), "-f", timeout_s=45)  # already over: at once
    assert ended.returncode == 0 and ended.stdout.endswith("no newline") and ended.elapsed_s < 15, ended.output
