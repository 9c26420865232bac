"""What the supervisor's verbs share: the error a request fails with, progress lines, polling."""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.host import procs

POLL_S = 0.05  # how often a verb looks at the process table or a record again
KILL_WAIT_S = 5.0  # after SIGKILL, how long a process may take to leave the table

Progress = Callable[[str], None]


class SupervisorError(Exception):
    """A request that cannot be carried out; the message is a sentence for the user."""


class BadRequest(SupervisorError):
    """The request itself is wrong (a working directory that is not there, an empty command word, a run id taken):
    bad input, not a failure to carry it out. The agent's reply says so (``error_kind = "input"``) and a headless
    client exits 2 on it, as it does for its own bad arguments."""


def noop(_: str) -> None:
    return None


def tree_of(pid: int | None) -> list[int]:
    return procs.tree_pids(pid) if pid else []


def state_of(pid: int) -> str:
    st = procs.read_stat(pid)
    return procs.state_name(st.state) if st is not None else "gone"


def wait_until(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
