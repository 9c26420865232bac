"""Helpers shared by the adversarial tests (no tests here): options for the test sshd, the server side of an
SSH session found through /proc, and a byte-exact collector of a session's log stream."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine import protocol
from tui.link.events import ClientEvent, ConnectionEvent
from tui.link.session import ConnectOptions, Session


def ssh_options(sshd: Any, run_root: Path | None = None, **extra: Any) -> ConnectOptions:
    """Options that reach the test sshd with its own key and known_hosts (never the user's ~/.ssh), with a 2 s
    keepalive: these tests cut links and want the cut noticed."""
    return sshd.options(run_root, **{"keepalive_s": 2.0, **extra})


def stat_fields(pid: int) -> tuple[str, int] | None:
    """(comm, ppid) of a live process, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    comm = raw[raw.index(b"(") + 1 : raw.rindex(b")")].decode("utf-8", "replace")
    rest = raw[raw.rindex(b")") + 2 :].split()
    return comm, int(rest[1])


def sshd_session_of(pid: int) -> int:
    """The sshd process serving the SSH session in which ``pid`` runs: the nearest ancestor named sshd*."""
    seen: list[str] = []
    cur = pid
    for _ in range(16):
        st = stat_fields(cur)
        if st is None:
            break
        comm, ppid = st
        seen.append(f"{cur}:{comm}")
        if cur != pid and comm.startswith("sshd"):
            return cur
        if ppid <= 1:
            break
        cur = ppid
    raise AssertionError(f"no sshd ancestor of pid {pid}: chain {seen}")


class LogCollector:
    """A session listener that rebuilds the followed log byte for byte and records every anomaly.

    Every ``log`` event must start exactly where the bytes received so far end (no gap, no overlap);
    a ``log_reset`` is accepted only at offset 0 before any byte (the run's log appearing). Anything
    else is recorded in ``problems`` and fails the test that checks it.
    """

    def __init__(self, run_id: str | None = None) -> None:
        self.data = bytearray()
        self.problems: list[str] = []
        self.states: list[str] = []
        self.hellos: list[int] = []
        self.events = 0
        self.run_id = run_id
        self.errors: list[str] = []

    def __call__(self, ev: ClientEvent) -> None:
        if isinstance(ev, protocol.LogEvent):
            self.events += 1
            if ev.offset != len(self.data):
                self.problems.append(f"log event at offset {ev.offset} while {len(self.data)} bytes were received")
                return
            self.data.extend(ev.raw)
        elif isinstance(ev, protocol.LogResetEvent):
            if ev.offset != 0 or self.data:
                self.problems.append(f"unexpected log_reset {ev} after {len(self.data)} bytes")
        elif isinstance(ev, ConnectionEvent):
            self.states.append(ev.state)
        elif isinstance(ev, protocol.HelloEvent):
            self.hellos.append(ev.pid or 0)
        elif isinstance(ev, protocol.ErrorEvent):
            self.errors.append(ev.message)


def agent_pid_of(session: Session) -> int:
    """The PID of the agent the session is (or was last) connected to, as its hello said."""
    assert session.agent is not None and session.agent.pid is not None, "the agent said no hello with its pid"
    return session.agent.pid
