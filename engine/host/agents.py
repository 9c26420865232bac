"""The specdec agents alive on this machine, as they recorded themselves: one empty file per agent in
``<run_root>/agents/``, named ``<pid>-<start ticks>``, made when it starts serving and removed when it ends.

kill-stale and the stale-holder anomaly leave an agent alone because it is one (it holds /dev/nvidia* for NVML,
never a GPU context), not because its command line says ``engine.agent.main``: any process can say that. A name
is trusted only while the process with that pid still has that start time; an entry of an agent that died is
removed by the next agent that starts.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from engine.host import procs

AGENTS_DIR = "agents"
_ENTRY = re.compile(r"([1-9][0-9]{0,9})-([0-9]{1,20})")


def agents_dir(run_root: Path | str) -> Path:
    return Path(run_root).expanduser() / AGENTS_DIR


def register(run_root: Path | str) -> Path | None:
    """Record this process as a live agent of ``run_root`` (and drop the entries of agents that died); the entry's
    path, None when the run root cannot be written (the agent still serves: it is then only not recognised)."""
    ticks = procs.start_ticks_of(os.getpid())
    if ticks is None:
        return None
    folder = agents_dir(run_root)
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        entry = folder / f"{os.getpid()}-{ticks}"
        entry.touch(mode=0o600)
    except OSError:
        return None
    for pid, start in _entries(folder):
        if not procs.process_alive(pid, start):
            with contextlib.suppress(OSError):
                (folder / f"{pid}-{start}").unlink()
    return entry


def unregister(entry: Path | None) -> None:
    if entry is not None:
        with contextlib.suppress(OSError):
            entry.unlink()


def live_agents(run_root: Path | str) -> set[int]:
    """The pids of the agents of ``run_root`` alive now, each still the process that recorded itself."""
    return {pid for pid, start in _entries(agents_dir(run_root)) if procs.process_alive(pid, start)}


def _entries(folder: Path) -> list[tuple[int, int]]:
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    out = []
    for name in names:
        m = _ENTRY.fullmatch(name)
        if m is not None:
            out.append((int(m.group(1)), int(m.group(2))))
    return out
