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

import contextlib
import heapq
import json
import math
import os
import re
import secrets
import stat
import time
from collections import Counter
from pathlib import Path
from typing import Any

from engine.protocol import RunIdError, validate_run_id

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
RANK_EVENTS_FILES_MAX = 64  # a node runs a few ranks (one per GPU): of more such files the lowest ranks' are read


def rank_events_names(run_dir: Path | str) -> list[str]:
    """The events.rank<R>.jsonl files of a run directory by name, at most RANK_EVENTS_FILES_MAX (the lowest ranks);
    OSError when the directory cannot be listed."""
    ranks = {int(m.group(1)): n for n in os.listdir(run_dir) if (m := RANK_EVENTS_RE.fullmatch(n)) is not None}
    return sorted(ranks[r] for r in heapq.nsmallest(RANK_EVENTS_FILES_MAX, ranks))


def new_run_id(now: float | None = None) -> str:
    """A fresh run id like 20261129-113500-ab12 (local time, then 4 random hex digits)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now if now is not None else time.time()))
    return f"{stamp}-{secrets.token_hex(2)}"


def runs_dir(run_root: Path | str) -> Path:
    return Path(run_root) / RUNS_DIR


def run_dir_for(run_root: Path | str, run_id: str) -> Path:
    return runs_dir(run_root) / validate_run_id(run_id)


def _current_target(run_root: Path | str) -> tuple[Path | None, str | None]:
    """(the run directory <run_root>/current points at, None) or (None, why it is refused; None: no link at all)."""
    link = Path(run_root) / CURRENT_LINK
    try:
        target = os.readlink(link)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"{link} cannot be read as a link: {exc.strerror or exc}"
    path = Path(target) if os.path.isabs(target) else Path(run_root) / target
    # The link is the run root's to write, but anyone who can write there could point it at /etc: only a directory
    # of <run_root>/runs, named as run ids are, is a run.
    real, runs_real = os.path.realpath(path), os.path.realpath(runs_dir(run_root))
    if os.path.dirname(real) != runs_real:
        return None, f"{link} points outside {runs_dir(run_root)} (to {target}); refused"
    try:
        validate_run_id(os.path.basename(real))
    except RunIdError as exc:
        return None, f"{link} points at {target}, which is not a run directory: {exc}"
    if not os.path.isdir(real):
        return None, f"{link} points at {target}, which is not a directory"
    return path, None


def current_run_dir(run_root: Path | str) -> Path | None:
    """The run directory <run_root>/current points at, or None when there is no (valid) current run (a link out
    of <run_root>/runs is not followed: ``current_refusal`` says why)."""
    return _current_target(run_root)[0]


def current_refusal(run_root: Path | str) -> str | None:
    """Why <run_root>/current is not taken as the current run (None: it is, or there is no link)."""
    return _current_target(run_root)[1]


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
    """Run directories, oldest first: by the launch time a generated id spells (new_run_id), else by the
    directory's mtime (a chosen id). Not by mtime alone: a run's directory changes when it ends, and a run that
    ended then sorted after newer ones still going."""
    try:
        entries = [p for p in runs_dir(run_root).iterdir() if p.is_dir()]
    except OSError:
        return []
    return oldest_first(entries)


def oldest_first(run_dirs: list[Path]) -> list[Path]:
    """``run_dirs`` in launch order (list_runs's). Runs launched within one second (their generated ids differ only
    in the random part) are ordered by the launch time their submitted.json records."""
    keyed = [(_started_key(p), p) for p in run_dirs]
    per_second = Counter(k for k, _ in keyed)

    def order(item: tuple[float, Path]) -> tuple[float, float, str]:
        started, p = item
        return started, _submitted_t(p) if per_second[started] > 1 else 0.0, p.name

    return [p for _, p in sorted(keyed, key=order)]


def _submitted_t(run_dir: Path) -> float:
    """The launch time submitted.json records; +inf when it has none (yet): such a run sorts after its second's."""
    t = (read_json(run_dir / SUBMITTED_JSON) or {}).get("t")
    if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t):
        return float(t)
    return math.inf


_GENERATED_ID = re.compile(r"(\d{8}-\d{6})-[0-9a-f]{4}")


def _started_key(run_dir: Path) -> float:
    """When the run was launched: the local time its generated id spells, else its directory's mtime."""
    m = _GENERATED_ID.fullmatch(run_dir.name)
    if m is not None:
        with contextlib.suppress(ValueError, OverflowError):
            return time.mktime(time.strptime(m.group(1), "%Y%m%d-%H%M%S"))
    try:
        return run_dir.stat().st_mtime
    except OSError:  # removed since it was listed
        return 0.0


RECORD_MAX_BYTES = 16 << 20  # a run record is a few KiB; one bigger than this is not ours


def read_json(path: Path | str) -> dict[str, Any] | None:
    """A JSON object from a file; None when missing or not (yet) a JSON object. Only a regular file is read (a FIFO
    planted in a run directory would block the open and the read for good), at most RECORD_MAX_BYTES."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            data = fh.read(RECORD_MAX_BYTES + 1)
        if len(data) > RECORD_MAX_BYTES:
            return None
        obj = json.loads(data)
    except (OSError, ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None
