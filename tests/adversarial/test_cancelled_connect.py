"""A connect that is cancelled halfway (the user quits while the agent is still starting, or close() ends a
reconnect in flight) must leave nothing behind: the agent it started is gone and its pipes are closed.

Before this was checked, a cancel while the client waited for the agent's hello left that agent running, its stdin
open, for as long as the client lived; and its asyncio transport unclosed, which raised "Event loop is closed" from
a finalizer whenever the collector reached it after the loop had ended (once inside another test's ast.parse).
Real parts: the real LocalTransport and Session, a stand-in agent that never says hello, real processes.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sys
import warnings
from pathlib import Path

import pytest
from support.procfs import pid_alive
from support.waiting import wait_until_async

from tui.link.session import ConnectOptions, open_session

# Starts as the agent starts (a child with pipes), records its pid, sends no hello, and exits when its stdin
# closes, as the real agent does.
SILENT = r"""#!{python}
import os, sys
with open({pidfile!r}, "w") as fh:
    fh.write(str(os.getpid()))
sys.stdin.buffer.read()
"""


def _silent_agent(tmp_path: Path) -> tuple[Path, Path]:
    pidfile = tmp_path / "agent.pid"
    fake = tmp_path / "silent-agent"
    fake.write_text(SILENT.format(python=sys.executable, pidfile=str(pidfile)))
    fake.chmod(0o755)
    return fake, pidfile


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_a_connect_cancelled_while_waiting_for_the_hello_leaves_no_agent_and_no_open_pipe(
    how: str, tmp_path: Path
) -> None:
    fake, pidfile = _silent_agent(tmp_path)
    session = open_session("local", ConnectOptions(python=str(fake), run_root=str(tmp_path), connect_timeout_s=5.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        task = asyncio.ensure_future(session.connect())
        await wait_until_async(lambda: pidfile.exists() and pidfile.read_text(), 20, "the stand-in agent to start")
        pid = int(pidfile.read_text())
        assert pid_alive(pid)
        if how == "cancel":
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        else:  # a caller's own deadline: wait_for cancels the connect the same way
            with pytest.raises(asyncio.TimeoutError):
                await asyncio.wait_for(task, 0.5)
        # the cancelled connect itself ends the agent (its stdin closed), before anyone calls close()
        await wait_until_async(lambda: not pid_alive(pid), 6, "the cancelled connect's agent to exit")
        await session.close()
        del task
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not unclosed, unclosed
