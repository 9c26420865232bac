"""The restart policy: a run that crashes, hangs or dies of CUDA OOM is started again, in the same run.

A profile's ``restart = { on = ["crash", "hang", "oom"], max = 3, backoff_s = 30 }`` reaches the launch
wrapper in the LaunchSpec; the wrapper (on the host, under tmux: no client needs to be connected) applies it:

* ``crash``: the job exited non-zero or was killed by a signal nobody sent through the supervisor;
* ``hang``: no step (a step event in events.jsonl, or an output.log line matching the step pattern) for
  ``stall_s`` seconds; before the attempt's first step the bound is the larger of ``stall_s`` and the
  profile's first-step deadline (loading a model is not a hang). The wrapper dumps every thread's stack
  (``stacks/hang-attempt-N.txt``), then stops the job: SIGTERM to its process group, ``grace_s``, SIGKILL;
* ``oom``: it failed and the last lines of its output name ``torch.OutOfMemoryError`` / "CUDA out of
  memory"; the next attempts run with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` added. An OOM
  counts as a crash when only ``crash`` is listed.

A restart is a new attempt of the same run: the same id and directory, output.log appended after a
separator line, ``restarts.json`` (records.RESTARTS_JSON) listing every restart (attempt, cause, when,
exit code); exit.json is written once, when the run ends for good. Our engine resumes from its newest
checkpoint on its own (``resume = true``); any other command is simply run again. ``max`` restarts at
most, then the run ends with the causes listed. ``stop`` cancels the policy: the wrapper restarts
nothing after a stop, and a stop during the backoff ends the run at once.

The table itself (keys, defaults, ``parse_policy``) is defined with the wire protocol (engine/protocol/run_words.py),
since the client checks a profile's table before it sends it. Stdlib only.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.host.appended import AppendedFile
from engine.protocol import (  # the policy is part of the LaunchSpec: defined with the wire protocol
    Policy,
)

ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"
OOM_MARKERS: tuple[bytes, ...] = (b"OutOfMemoryError", b"CUDA out of memory")
OOM_TAIL_LINES = 200  # torchrun prints every rank's traceback and its summary after the OOM line
OOM_TAIL_BYTES = 256 * 1024
READ_BUDGET_BYTES = 4 * 1024 * 1024  # of output.log / events.jsonl one progress poll reads at most
_STEP_EVENT_RE = re.compile(rb'"kind"\s*:\s*"step"')

# restarts.json "state": what the policy is doing now.
STATES: tuple[str, ...] = (
    "watching",  # an attempt is running under the policy
    "backoff",  # an attempt ended with a cause in `on`: waiting backoff_s before the next
    "gave_up",  # `max` restarts done and the last attempt failed too
    "cancelled",  # stopped (stop, or a signal to the wrapper): nothing restarted after it
    "done",  # the run ended in a way the policy does not restart (success, or a cause not in `on`)
)


@dataclass
class Ending:
    """How one attempt ended, as the wrapper saw it."""

    exit_code: int | None  # None when killed by a signal
    signal: int | None
    detail: str  # "exited with code 1", "killed by signal 9 (SIGKILL)"
    hang: str | None = None  # why the wrapper stopped it as hung
    oom: str | None = None  # the output line that names a CUDA OOM
    stacks: str | None = None  # where the hang's stack dump went, or why there is none
    reason: str | None = None  # the attempt's own root cause, in its words (records.root_cause), or a full disk
    ended_at: float = 0.0  # when the wrapper reaped it (unix time)
    stopped: str | None = None  # it ended because a stop asked it to (records.stopped_cause): never restarted

    @property
    def ok(self) -> bool:
        return self.hang is None and self.exit_code == 0 and self.signal is None


def restart_cause(ending: Ending, policy: Policy) -> str | None:
    """The cause to restart for (one of CAUSES), or None when the policy does not restart this ending."""
    if ending.stopped is not None:
        return None  # the user asked for this end
    if ending.hang is not None:
        return "hang" if "hang" in policy.on else None
    if ending.ok:
        return None
    if ending.oom is not None and "oom" in policy.on:
        return "oom"
    return "crash" if "crash" in policy.on else None


def find_oom(log_path: Path | str, start_offset: int) -> str | None:
    """The first of the last lines after ``start_offset`` of output.log that names a CUDA OOM; None when none does."""
    try:
        with open(log_path, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            begin = max(start_offset, size - OOM_TAIL_BYTES)
            fh.seek(begin)
            data = fh.read(size - begin)
    except OSError:
        return None
    for line in data.replace(b"\r", b"\n").split(b"\n")[-OOM_TAIL_LINES:]:
        if any(m in line for m in OOM_MARKERS):
            text = line.decode("utf-8", "replace").strip()
            return text if len(text) <= 200 else text[:199] + "…"
    return None


def with_expandable_segments(env: dict[str, str]) -> tuple[dict[str, str], str]:
    """The job's environment for the attempt after an OOM, and a sentence saying what changed."""
    out = dict(env)
    current = out.get(ALLOC_CONF_ENV, "")
    if "expandable_segments" in current:
        return out, f"{ALLOC_CONF_ENV}={current} already sets expandable_segments: left as it is"
    out[ALLOC_CONF_ENV] = f"{current},{EXPANDABLE_SEGMENTS}" if current else EXPANDABLE_SEGMENTS
    return out, f"{ALLOC_CONF_ENV}={out[ALLOC_CONF_ENV]} added to the job's environment"


PROGRESS_LINE_ENDS = (b"\n", b"\r")  # a progress bar redraws with \r: each redraw is a line here
MAX_PROGRESS_CARRY_BYTES = 64 * 1024  # a line without end is searched as it is beyond this


def complete_lines(appended: AppendedFile) -> bytes:
    """The complete lines appended since the last call (a file replaced or truncated is read from its start)."""
    st, _reason = appended.check()
    if st is None or st.st_size <= appended.position:
        return b""
    data = appended.read_path(min(READ_BUDGET_BYTES, st.st_size - appended.position))
    _start, complete = appended.take_complete(data, PROGRESS_LINE_ENDS, MAX_PROGRESS_CARRY_BYTES)
    return complete


class ProgressWatch:
    """When one attempt last made progress: a step event in events.jsonl or a step-pattern line in output.log."""

    def __init__(
        self,
        log_path: Path,
        events_path: Path,
        step_pattern: str,
        started_at: float,
        stall_s: float,
        first_step_deadline_s: float | None,
    ) -> None:
        self._log = AppendedFile(log_path, _size(log_path))
        self._events = AppendedFile(events_path, _size(events_path))
        self._step_re = re.compile(step_pattern.encode())
        self.started_at = started_at
        self.last_step_seen_at: float | None = None
        self.stall_s = stall_s
        self.first_step_bound_s = max(stall_s, first_step_deadline_s or 0.0)

    def poll(self, now: float) -> None:
        in_log = self._step_re.search(complete_lines(self._log)) is not None
        in_events = _STEP_EVENT_RE.search(complete_lines(self._events)) is not None
        if in_log or in_events:
            self.last_step_seen_at = now

    def hung(self, now: float) -> str | None:
        """Why the attempt counts as hung now; None while it is within its bound."""
        if self.last_step_seen_at is None:
            idle_s = now - self.started_at
            if idle_s <= self.first_step_bound_s:
                return None
            return f"no step {idle_s:.1f} s after the attempt started (bound {self.first_step_bound_s:g} s)"
        idle_s = now - self.last_step_seen_at
        if idle_s <= self.stall_s:
            return None
        return f"no step for {idle_s:.1f} s (stall_s {self.stall_s:g})"


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def summary(restarts: list[dict[str, Any]]) -> str:
    """ "crash, oom" for the causes of a run's restarts, in order."""
    return ", ".join(str(r.get("cause")) for r in restarts)


def attempts_said(restarts: list[dict[str, Any]]) -> str:
    """ "attempt 1: ValueError: first; attempt 2: KeyError: second": each restarted attempt's own cause, in order."""
    return "; ".join(f"attempt {r.get('attempt')}: {r.get('reason') or r.get('detail')}" for r in restarts)
