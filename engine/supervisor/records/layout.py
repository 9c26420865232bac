"""A run's ids and the run directory layout: where each record of a run lives on disk.

Layout::

    <run_root>/current            symlink to the newest run directory
    <run_root>/runs/<run_id>/
        submitted.json            written by the launcher once tmux (or setsid) accepted the wrapper
        spec.json                 the LaunchSpec the wrapper runs (restart reuses it)
        launch.json               written by the wrapper: ids, command, cwd, pids, boot id, start time
        milestones.json           first output / first step times, as the wrapper saw them
        output.log                the job's stdout and stderr
        exit.json                 exit code or signal, written atomically when the job ends
        .exit.reserved            space for exit.json, taken before the job starts (used when the disk is full)
        restarts.json             under a restart policy: each restart's attempt, cause, time and exit (restart.py)
        events.jsonl              the engine's structured events (under torchrun: local rank 0 of this node)
        events.rank<R>.jsonl      the events of global rank R, another rank of this node
        checkpoints/              the engine's checkpoints

"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

from engine.protocol import validate_run_id

RUNS_DIR = "runs"
CURRENT_LINK = "current"
SUBMITTED_JSON = "submitted.json"
SPEC_JSON = "spec.json"
LAUNCH_JSON = "launch.json"
MILESTONES_JSON = "milestones.json"
EXIT_JSON = "exit.json"
EXIT_RESERVED = ".exit.reserved"  # the exit record's blocks, allocated at launch (a full disk cannot lose the exit)
OUTPUT_LOG = "output.log"
EVENTS_JSONL = "events.jsonl"
RESTARTS_JSON = "restarts.json"  # engine/supervisor/restart.py writes it through the wrapper
CHECKPOINTS_DIR = "checkpoints"
RANK_EVENTS_RE = re.compile(r"events\.rank(\d+)\.jsonl")


def new_run_id(now: float | None = None) -> str:
    """A fresh run id like 20261129-113500-ab12 (local time, then 4 random hex digits)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(2)}"


def runs_dir(run_root: Path | str) -> Path:
    return Path(run_root) / RUNS_DIR


def run_dir_for(run_root: Path | str, run_id: str) -> Path:
    return runs_dir(run_root) / validate_run_id(run_id)


def current_run_dir(run_root: Path | str) -> Path | None:
    """The run directory <run_root>/current points at, or None when there is no (valid) current run."""
    link = Path(run_root) / CURRENT_LINK
    try:
        target = os.readlink(link)
    except OSError:
        return None
    path = Path(target) if os.path.isabs(target) else Path(run_root) / target
    return path if path.is_dir() else None


def set_current(run_root: Path | str, run_dir: Path) -> None:
    """Point <run_root>/current at run_dir, atomically (a new symlink renamed over the old one)."""
    root = Path(run_root)
    rel = os.path.relpath(run_dir, root)
    tmp = root / f".{CURRENT_LINK}.{os.getpid()}.{secrets.token_hex(4)}"
    os.symlink(rel, tmp)
    try:
        os.replace(tmp, root / CURRENT_LINK)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def list_runs(run_root: Path | str) -> list[Path]:
    """Run directories, oldest first (by name: generated ids sort by time)."""
    try:
        entries = sorted(runs_dir(run_root).iterdir(), key=lambda p: (p.stat().st_mtime, p.name))
    except OSError:
        return []
    return [p for p in entries if p.is_dir()]
