"""Whether a filesystem is full: the run root's, for the agent's ``disk_full`` anomaly and a failed run's cause."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DISK_FULL_MAX_BYTES = 64 * 1024 * 1024  # below this much free space the run root counts as full...
DISK_FULL_FRACTION = 0.02  # ...or below this fraction of a small filesystem


def full_usage(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(free, total) bytes of the filesystem of PATH when it is full, else None (also when unreadable).
    A path not there yet is judged by its nearest existing parent."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return None
    if usage.free >= min(DISK_FULL_MAX_BYTES, usage.total * DISK_FULL_FRACTION):
        return None
    return usage.free, usage.total


def full_note(path: str | os.PathLike[str]) -> str | None:
    """ "the filesystem of PATH is full (12 KiB free of 1024 KiB)" when it is, else None."""
    full = full_usage(path)
    if full is None:
        return None
    return f"the filesystem of {path} is full ({full[0] // 1024} KiB free of {full[1] // 1024} KiB)"
