"""Connection faults under load: the SSH link cut 20 times during a 50k lines/s burst, and the agent
killed with SIGKILL. The client (tui.link.session.Session with streams) must reconnect by itself and rebuild
the job's output.log byte for byte; the job must not notice.

Everything is real: the OpenSSH sshd on 127.0.0.1 (tests/integration/conftest.py), the shipped agent,
the supervisor's wrapper in a private tmux server, the files on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from adv_support import LogCollector, agent_pid_of, ssh_options, sshd_session_of
from support.procfs import pid_alive
from support.waiting import wait_until_async

from engine.supervisor import records
from tui.link.events import ConnectionEvent
from tui.link.session import ConnectOptions, Session, open_session

pytestmark = [pytest.mark.ssh, pytest.mark.tmux]

# Writes numbered lines at RATE lines/s (in slices of 1/50 s) until the stop file exists, then exits 0.
WRITER = r"""
import os, sys, time
stop, rate = sys.argv[1], int(sys.argv[2])
out = sys.stdout.buffer
i = 0
t0 = time.monotonic()
while not os.path.exists(stop):
    due = int((time.monotonic() - t0) * rate)
    if i < due:
        n = min(due - i, max(1, rate // 50))
        out.write(b"".join(b"%09d adversarial burst line\n" % k for k in range(i, i + n)))
        out.flush()
        i += n
    else:
        time.sleep(0.002)
out.write(b"writer done after %d lines in %.2f s\n" % (i, time.monotonic() - t0))
out.flush()
"""

DROPS = 20
RATE_LINES_S = 50_000


def _fast_reconnect(session: Session) -> None:
    session.backoff_base_s = 0.05
    session.backoff_cap_s = 0.5


async def _launch_writer(session: Session, stop: Path, rate: int) -> dict[str, Any]:
    return await session.request(
        "launch", timeout_s=60.0, command=[sys.executable, "-c", WRITER, str(stop), str(rate)], cwd=str(stop.parent)
    )


async def _finish(session: Session, run_root: Path, run_id: str, stop: Path, got: LogCollector) -> bytes:
    """Stop the writer, wait for its exit record and for every byte of its log; returns the file's bytes."""
    stop.write_text("")
    run_dir = records.run_dir_for(run_root, run_id)
    await wait_until_async(lambda: (run_dir / records.EXIT_JSON).exists(), 60, "the writer's exit record")
    log = run_dir / records.OUTPUT_LOG
    await wait_until_async(lambda: len(got.data) >= log.stat().st_size, 120, "the client to receive the whole log")
    await asyncio.sleep(0.3)  # anything after the end would be a duplicate: give it the chance to show
    return log.read_bytes()


def _assert_job_never_noticed(run_root: Path, run_id: str, data: bytes) -> int:
    run_dir = records.run_dir_for(run_root, run_id)
    exit_rec = records.read_json(run_dir / records.EXIT_JSON) or {}
    assert exit_rec.get("exit_code") == 0 and exit_rec.get("signal") is None, exit_rec
    lines = data.split(b"\n")
    assert lines[-2].startswith(b"writer done after"), lines[-2:]
    n = int(lines[-2].split()[3])
    # Every line the writer counted is there, numbered 0..n-1 in order: the job's own view agrees.
    assert len(lines) == n + 2
    assert lines[0] == b"000000000 adversarial burst line" and lines[n - 1].startswith(b"%09d " % (n - 1))
    return n


@pytest.mark.slow
async def test_twenty_ssh_drops_during_a_50k_lines_per_second_burst_lose_and_repeat_nothing(
    sshd: Any, run_root: Path, tmp_path: Path
) -> None:
    session = open_session(sshd.target, ssh_options(sshd, run_root))
    _fast_reconnect(session)
    got = LogCollector()
    session.add_event_listener(got)
    stop = tmp_path / "stop-writer"
    main_sshd = int((sshd.dir / "sshd.pid").read_text().split()[0])
    await session.connect()
    drops: list[dict[str, float]] = []
    try:
        await session.start_streams(gpu_interval_s=2.0, procs_interval_s=2.0)
        launched = await _launch_writer(session, stop, RATE_LINES_S)
        run_id = str(launched["run_id"])
        await wait_until_async(lambda: len(got.data) > 100_000, 30, "the burst to reach the client")
        t_burst = time.monotonic()
        for i in range(DROPS):
            agent_pid = agent_pid_of(session)
            server = sshd_session_of(agent_pid)
            assert server != main_sshd, "would kill the listening sshd, not the session's"
            before = len(got.data)
            t0 = time.monotonic()
            os.kill(server, signal.SIGKILL)  # the server side of this session dies: the TCP connection is cut
            await wait_until_async(lambda: session.state != "connected", 10, f"drop {i + 1} to be noticed")
            t_noticed = time.monotonic()
            await wait_until_async(
                lambda old=agent_pid: session.state == "connected" and agent_pid_of(session) != old,
                30,
                f"reconnect after drop {i + 1}",
            )
            t_back = time.monotonic()
            await wait_until_async(
                lambda b=before: len(got.data) > b + 50_000, 30, f"the stream to resume after drop {i + 1}"
            )
            drops.append(
                {"noticed_s": t_noticed - t0, "reconnected_s": t_back - t0, "resumed_s": time.monotonic() - t0}
            )
            assert not pid_alive(server)
            assert not got.problems, got.problems[:3]
        burst_s = time.monotonic() - t_burst
        data = await _finish(session, run_root, run_id, stop, got)
    finally:
        stop.touch()
        await session.close()
    assert not got.problems, got.problems[:5]
    assert bytes(got.data) == data, f"received {len(got.data)} bytes, the file has {len(data)}"
    n = _assert_job_never_noticed(run_root, run_id, data)
    assert len(drops) == DROPS and got.states.count("reconnecting") >= DROPS
    assert len(set(got.hellos)) == DROPS + 1  # a fresh agent after every drop
    assert n / max(burst_s, 1e-9) > 25_000, f"the writer managed only {n / burst_s:.0f} lines/s: no burst"
    worst = max(d["resumed_s"] for d in drops)
    print(
        f"\n[adversarial] {DROPS} SSH drops survived during a {burst_s:.1f} s burst; {n} lines / {len(data)} bytes "
        f"compared byte for byte (0 lost, 0 duplicated); writer rate {n / max(burst_s, 1e-9):.0f} lines/s; "
        f"reconnect median {sorted(d['reconnected_s'] for d in drops)[DROPS // 2]:.2f} s, worst resume {worst:.2f} s"
    )


def _local_options(run_root: Path) -> ConnectOptions:
    return ConnectOptions(run_root=str(run_root), python=sys.executable, connect_timeout_s=5.0)


@pytest.mark.parametrize("where", ["local", "ssh"])
async def test_agent_killed_with_sigkill_is_noticed_within_two_seconds_and_nothing_is_lost(
    where: str, sshd: Any, run_root: Path, tmp_path: Path
) -> None:
    opts = _local_options(run_root) if where == "local" else ssh_options(sshd, run_root)
    session = open_session("local" if where == "local" else sshd.target, opts)
    _fast_reconnect(session)
    got = LogCollector()
    noticed_at: list[float] = []
    session.add_event_listener(got)
    session.add_event_listener(
        lambda ev: (
            noticed_at.append(time.monotonic())
            if isinstance(ev, ConnectionEvent) and ev.state == "reconnecting"
            else None
        )
    )
    stop = tmp_path / "stop-writer"
    await session.connect()
    notice_s: list[float] = []
    try:
        await session.start_streams(gpu_interval_s=1.0, procs_interval_s=1.0)
        run_id = str((await _launch_writer(session, stop, 5_000))["run_id"])
        await wait_until_async(lambda: len(got.data) > 10_000, 30, "the log to reach the client")
        for i in range(3):
            agent_pid = agent_pid_of(session)
            before = len(got.data)
            noticed_at.clear()
            t0 = time.monotonic()
            os.kill(agent_pid, signal.SIGKILL)
            await wait_until_async(lambda: noticed_at, 5, f"the client to notice the dead agent ({i + 1})")
            notice_s.append(noticed_at[0] - t0)
            await wait_until_async(
                lambda old=agent_pid: session.state == "connected" and agent_pid_of(session) != old,
                30,
                "a new agent",
            )
            await wait_until_async(lambda b=before: len(got.data) > b + 5_000, 30, "the stream to resume")
        data = await _finish(session, run_root, run_id, stop, got)
    finally:
        stop.touch()
        await session.close()
    assert max(notice_s) < 2.0, f"noticed after {notice_s} s"
    assert not got.problems, got.problems[:5]
    assert bytes(got.data) == data
    _assert_job_never_noticed(run_root, run_id, data)
    print(f"\n[adversarial] agent SIGKILL over {where}: noticed after {[round(s, 3) for s in notice_s]} s")


@pytest.mark.slow
async def test_a_frozen_server_side_is_abandoned_and_the_stream_resumes_losslessly(
    sshd: Any, run_root: Path, tmp_path: Path
) -> None:
    """The link goes silent (the session's sshd stopped with SIGSTOP: no FIN, no RST, TCP still up): keepalives
    or missed pings must give it up, reconnect and resume, with the burst going on."""
    session = open_session(sshd.target, ssh_options(sshd, run_root, keepalive_s=2.0))
    _fast_reconnect(session)
    got = LogCollector()
    session.add_event_listener(got)
    stop = tmp_path / "stop-writer"
    frozen: int | None = None
    await session.connect()
    try:
        await session.start_streams(gpu_interval_s=1.0, procs_interval_s=1.0)
        run_id = str((await _launch_writer(session, stop, 20_000))["run_id"])
        await wait_until_async(lambda: len(got.data) > 50_000, 30, "the burst to reach the client")
        agent_pid = agent_pid_of(session)
        frozen = sshd_session_of(agent_pid)
        t0 = time.monotonic()
        os.kill(frozen, signal.SIGSTOP)
        await wait_until_async(lambda: session.state != "connected", 30, "the silent link to be given up")
        noticed_s = time.monotonic() - t0
        await wait_until_async(
            lambda: session.state == "connected" and agent_pid_of(session) != agent_pid, 30, "reconnect"
        )
        before = len(got.data)
        await wait_until_async(lambda: len(got.data) > before + 50_000, 30, "the stream to resume")
        data = await _finish(session, run_root, run_id, stop, got)
    finally:
        stop.touch()
        if frozen is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(frozen, signal.SIGKILL)  # a stopped process still dies of SIGKILL
        await session.close()
    assert not got.problems, got.problems[:5]
    assert bytes(got.data) == data
    _assert_job_never_noticed(run_root, run_id, data)
    print(f"\n[adversarial] frozen sshd: link given up after {noticed_s:.1f} s; {len(data)} bytes byte-exact")
