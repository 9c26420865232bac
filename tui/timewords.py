"""Times and durations as the CLI and the dashboard print them (runs lists, a run's header)."""

from __future__ import annotations

import time


def when(t: float | None, *, year: bool = True) -> str:
    """A moment in local time (``2026-12-01 10:15:00``; without the year ``12-01 10:15:00``), ``-`` for none."""
    if t is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S" if year else "%m-%d %H:%M:%S", time.localtime(t))


def duration(seconds: float | None) -> str:
    """``4m05s`` under an hour, ``2h07m`` from one, ``-`` for none."""
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
