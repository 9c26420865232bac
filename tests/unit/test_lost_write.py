"""A command the link can no longer take (the write fails at once) while the session's reader has yet to see the loss:
a following client's request waits for the next link and is sent there. It must never retry on the link it knows is
broken: that retry loop gives the event loop no turn, so the reader never sees the loss and the client spins for
good (seen as `logs -f` stuck at 100% CPU after an SSH drop, no reconnect; tests/integration/test_logs_cli.py).

Real parts: the shipped agent as a local subprocess (LocalTransport); the only cut is our end of its stdin, closed.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from tui.link.session import Session
from tui.link.transport import AgentStream, ConnectOptions, LocalTransport, Target


class _KeepsStreams(LocalTransport):
    """The local transport, keeping every agent stream it opened (the test cuts one)."""

    def __init__(self, target: Target, opts: ConnectOptions) -> None:
        super().__init__(target, opts)
        self.opened: list[Any] = []  # LocalTransport's streams: ``.proc`` is the agent's asyncio subprocess

    async def open(self) -> AgentStream:
        stream = await super().open()
        self.opened.append(stream)
        return stream


@pytest.mark.timeout(60)  # the fault this guards against spins without a turn for asyncio's timeouts
async def test_a_command_that_cannot_be_written_is_sent_again_on_the_next_link(tmp_path: Path) -> None:
    options = ConnectOptions(run_root=str(tmp_path / "root"), python=sys.executable, connect_timeout_s=5.0)
    transport = _KeepsStreams(Target(local=True), options)
    session = Session(transport, options)
    session.retry_lost_requests = True  # as `logs -f` has it (one node or several)
    session.backoff_base_s = 0.05
    await session.connect()
    try:
        assert session.agent is not None
        first_agent = session.agent.pid
        # Our end of the agent's stdin closed: writes fail at once; the agent sees EOF and exits, and the session's
        # reader learns of it on its next turn of the event loop.
        transport.opened[0].proc.stdin.close()
        await asyncio.wait_for(session.request("ping", timeout_s=10.0), 30.0)
        assert len(transport.opened) == 2, transport.opened
        assert session.state == "connected" and session.agent.pid != first_agent
    finally:
        await session.close()
