"""The incremental scan of a run: only what was appended to output.log and the events files since the last poll.

The wrapper times milestones with it as they happen, the agent's wait ends within one poll of a milestone, and
read_run (one scanner per run directory in a ``ScannerCache``) reads the engine's stage and last step from it.

Bounded whatever the files hold: an event line is at most 1 MiB; the first read of a huge events file takes its
head and its newest 8 MiB (the middle is counted, never read), the first look at a huge log its end; the thread
errors and ranks kept are capped, and what was dropped is counted in the state.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from engine import protocol
from engine.host.appended import AppendedFile
from engine.protocol import (
    ExportEvent,
    HeartbeatEvent,
    RunEndEvent,
    StageEvent,
    StepEvent,
    ThreadErrorEvent,
)
from engine.supervisor.records.documents import LaunchRecord
from engine.supervisor.records.layout import EVENTS_JSONL, OUTPUT_LOG, rank_events_names
from engine.supervisor.records.log_failure import Failure, FailureScan, last_step_in

_SCAN_BUDGET_BYTES = 8 * 1024 * 1024
LOG_LINE_MAX_BYTES = 64 * 1024  # a log "line" longer than this without an end is scanned as it is
EVENT_LINE_MAX_BYTES = 1024 * 1024  # an event line longer than this is no event: skipped, never held whole
# An events file larger than head + tail is read at its start (stages, each rank's distributed stage) and its end
# (the latest step, errors, run_end); the middle stays unread and is counted (``ScanState.skipped_event_bytes``).
EVENTS_HEAD_BYTES = 1024 * 1024
EVENTS_TAIL_BYTES = _SCAN_BUDGET_BYTES  # one poll reads it
THREAD_ERRORS_KEPT = 64  # per list: the first few (the root cause is the first) and the newest; the rest counted
THREAD_ERRORS_FIRST_KEPT = 8
RANKS_KEPT = 1024  # ranks with a state: events naming ever new ranks beyond are not kept (counted)
_KIND_RE = re.compile(rb'"kind"\s*:\s*"([a-z_]+)"')
_SCANNED_KINDS = frozenset(
    cls.KIND.encode() for cls in (StepEvent, StageEvent, ThreadErrorEvent, RunEndEvent, ExportEvent)
)
# Events only a running engine writes about its own progress: a job that writes them takes first-step from them
# (not from the step pattern); an error event alone (a job that died before training) does not make it an engine.
_PROGRESS_KINDS = frozenset(cls.KIND.encode() for cls in (StageEvent, HeartbeatEvent, StepEvent))
_NPROC_RE = re.compile(r"--nproc[-_]per[-_]node(?:=|$)")


@dataclass
class RankState:
    """One torchrun rank as its tagged events say (rank None: an engine outside torchrun)."""

    rank: int | None
    node: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None  # from its ``distributed`` stage event
    pid: int | None = None  # from its ``distributed`` stage event
    first_step_t: float | None = None
    last_step: int | None = None
    thread_errors: list[ThreadErrorEvent] = field(default_factory=list)  # bounded: see keep_thread_error
    run_end: RunEndEvent | None = None

    def label(self) -> str:
        return f"rank {self.rank}" + (f" (node {self.node})" if self.node is not None else "")


@dataclass
class ScanState:
    """What an incremental scan of a run's output.log and its events files has found so far."""

    output_seen_at: float | None = None  # when this scanner first saw a byte of job output
    log_step_seen_at: float | None = None  # a step-pattern line, for a job that writes no engine events
    first_step_t: float | None = None  # when every rank of this node had stepped (the last one's first step)
    stage: str | None = None
    last_step: int | None = None
    last_step_at: float | None = None
    thread_errors: list[ThreadErrorEvent] = field(default_factory=list)  # bounded: see keep_thread_error
    dropped_thread_errors: int = 0  # thread_error events seen but not kept (all ranks)
    dropped_rank_events: int = 0  # events of a rank beyond RANKS_KEPT others: not kept
    run_end: RunEndEvent | None = None
    last_export: str | None = None  # OUT_DIR of the newest `specdec-train export` event
    log_last_step: int | None = None  # the number in the last output.log line matching the step pattern
    failure: Failure = field(default_factory=Failure)  # exceptions and torchrun's root cause in output.log
    engine_events: bool = False  # the job writes engine events: first-step comes from them, not the step pattern
    ranks: dict[int | None, RankState] = field(default_factory=dict)
    nproc_hint: int | None = None  # --nproc-per-node of a torchrun command line, when the events do not say
    skipped_event_lines: int = 0  # event lines longer than EVENT_LINE_MAX_BYTES, skipped unread
    skipped_log_bytes: int = 0  # bytes of output.log never scanned: the start of a huge one (its end has the step)
    skipped_event_bytes: int = 0  # bytes of the events files left unread: a huge file's middle, the line it cut

    def ranks_expected(self) -> int:
        """How many ranks of this node write into this run directory."""
        if None in self.ranks or not self.ranks:
            return 1
        sizes = [r.local_world_size for r in self.ranks.values() if r.local_world_size]
        if sizes:
            return max(sizes)
        return max(self.nproc_hint or 0, len(self.ranks))

    def distributed(self) -> bool:
        return any(r is not None for r in self.ranks)


class RunScanner:
    """Reads only what was appended to output.log and events.jsonl since the last poll.

    Used by the wrapper (to time milestones as they happen), by the agent's wait (to end a wait
    within one poll of a milestone) and by read_run (cached per run dir, for the engine's stage).
    """

    def __init__(
        self, run_dir: Path | str, step_pattern: str | None, output_base: int = 0, nproc_hint: int | None = None
    ) -> None:
        self.run_dir = Path(run_dir)
        self._step_re = re.compile(step_pattern.encode()) if step_pattern else None
        self._failure = FailureScan()
        self._output_base = output_base
        self._log = AppendedFile(self.run_dir / OUTPUT_LOG, output_base)
        self._ev: dict[str, AppendedFile] = {}  # events file name -> how far it was read
        self._stepped: set[str] = set()  # events files whose first step was read
        self._lock = threading.Lock()  # the agent's status and wait threads share one scanner per run
        self.state = ScanState(nproc_hint=nproc_hint)
        self.state.failure = self._failure.failure

    def poll(self, now: float | None = None, budget_bytes: int = _SCAN_BUDGET_BYTES) -> ScanState:
        t = now if now is not None else time.time()
        with self._lock:
            self._poll_events(budget_bytes)  # first: a step line in the log of an engine run is not its first-step
            self._poll_log(t, budget_bytes)
        return self.state

    CATCH_UP_MAX_BYTES = 16 * 1024 * 1024  # of an ended run's log, read at once; beyond, only its end is read

    def catch_up(self, now: float | None = None) -> ScanState:
        """Scan an ended run's files to their end (its last step and cause are there), in budgeted passes."""
        t = now if now is not None else time.time()
        with self._lock:
            try:
                size = os.stat(self._log.path).st_size
            except OSError:
                size = 0
            if size - self._log.position > self.CATCH_UP_MAX_BYTES:
                self.state.skipped_log_bytes += size - self.CATCH_UP_MAX_BYTES - self._log.position
                self._log.restart(size - self.CATCH_UP_MAX_BYTES)
            for _ in range(self.CATCH_UP_MAX_BYTES // _SCAN_BUDGET_BYTES + 1):
                before = (self._log.position, sum(tail.position for tail in self._ev.values()))
                self._poll_events(_SCAN_BUDGET_BYTES)
                self._poll_log(t, _SCAN_BUDGET_BYTES)
                if (self._log.position, sum(tail.position for tail in self._ev.values())) == before:
                    break
            if self._log.carry and self._step_re is not None:  # the last line may have no newline
                step = last_step_in(self._log.carry, self._step_re)
                self.state.log_last_step = step if step is not None else self.state.log_last_step
        return self.state

    def _poll_log(self, now: float, budget: int) -> None:
        st, reset = self._log.check()
        if st is None:
            return
        if reset is not None:  # rotated or truncated: scan the new file from its start
            self._failure = FailureScan()
            self.state.failure, self.state.log_last_step = self._failure.failure, None
        if st.st_size <= self._log.position:
            return
        if self.state.output_seen_at is None and st.st_size > self._output_base:
            self.state.output_seen_at = now
        if self._log.position == self._output_base and st.st_size - self._output_base > self.CATCH_UP_MAX_BYTES:
            # A first look at a huge log (an agent meeting a long run): its end, where the latest step is.
            self.state.skipped_log_bytes += st.st_size - budget - self._output_base
            self._log.restart(st.st_size - budget)
        data = self._log.read_path(min(budget, st.st_size - self._log.position))
        if not data:
            return
        _, complete = self._log.take_complete(data, (b"\n", b"\r"), LOG_LINE_MAX_BYTES)
        if complete:
            self._failure.feed(complete)
        # A progress bar redraws after a \r and ends its current state with none: that partial line counts too.
        seen = complete + self._log.carry
        if self._step_re is not None and seen:
            step = last_step_in(seen, self._step_re)
            if step is not None:
                self.state.log_last_step = step
            if self.state.log_step_seen_at is None and not self.state.engine_events and self._step_re.search(seen):
                self.state.log_step_seen_at = now

    def _poll_events(self, budget: int) -> None:
        names = [EVENTS_JSONL]
        try:
            names += rank_events_names(self.run_dir)
        except OSError:
            return
        for name in names:
            self._poll_events_file(name, self._ev.setdefault(name, AppendedFile(self.run_dir / name)), budget)

    def _poll_events_file(self, name: str, tail: AppendedFile, budget: int) -> None:
        st, _ = tail.check()
        if st is None or st.st_size <= tail.position:
            return
        skipped_before = tail.skipped_bytes
        if tail.position == 0 and st.st_size > EVENTS_HEAD_BYTES + EVENTS_TAIL_BYTES:
            # A first read of a huge file: its head, then its newest lines; never every line in between.
            self._event_lines(name, tail, tail.read_path(EVENTS_HEAD_BYTES))
            tail.skip_to(st.st_size - EVENTS_TAIL_BYTES)
            budget = max(budget, EVENTS_TAIL_BYTES + 1)  # the skip reads again from the byte before the window
        self._event_lines(name, tail, tail.read_path(min(budget, st.st_size - tail.position)))
        self.state.skipped_event_bytes += tail.skipped_bytes - skipped_before

    def _event_lines(self, name: str, tail: AppendedFile, data: bytes) -> None:
        _, complete = tail.take_complete(data, max_carry_bytes=EVENT_LINE_MAX_BYTES)
        lines = complete.split(b"\n")
        if lines[-1]:  # the carry outgrew the bound: the start of an over-long line, dropped
            self.state.skipped_event_lines += 1
        kinds: list[bytes | None] = []
        for line in lines[:-1]:
            if len(line) > EVENT_LINE_MAX_BYTES:
                self.state.skipped_event_lines += 1
                kinds.append(None)
                continue
            m = _KIND_RE.search(line)
            kinds.append(m.group(1) if m is not None else None)
        # A file is one rank's: of its steps only the first ever (first-step) and the newest change the state, so
        # the steps in between are not decoded (a chunk of a busy run holds thousands).
        newest = self._newest_step(lines, kinds)
        for i, kind in enumerate(kinds):
            if kind is None:
                continue
            if kind == StepEvent.KIND.encode():
                self.state.engine_events = True
                if name in self._stepped and i != newest[0]:
                    continue
                ev = newest[1] if i == newest[0] else protocol.decode_engine_line(lines[i])
                if ev is not None:
                    self._stepped.add(name)
                    self._event(ev, name == EVENTS_JSONL)
                continue
            self._event_line(lines[i], kind, name == EVENTS_JSONL)

    @staticmethod
    def _newest_step(lines: list[bytes], kinds: list[bytes | None]) -> tuple[int, protocol.EngineEvent | None]:
        """(index, event) of the last step line of a chunk that decodes; (-1, None) without one."""
        for i in range(len(kinds) - 1, -1, -1):
            if kinds[i] == StepEvent.KIND.encode():
                ev = protocol.decode_engine_line(lines[i])
                if ev is not None:
                    return i, ev
        return -1, None

    def _event_line(self, line: bytes, kind: bytes, main: bool = True) -> None:
        """One event line of ``kind``; ``main``: from events.jsonl, whose rank (the node's first) speaks for the run."""
        if kind in _PROGRESS_KINDS:
            self.state.engine_events = True
        # Heartbeats are the bulk of the file and change nothing here: skipped before decoding.
        if kind not in _SCANNED_KINDS:
            return
        ev = protocol.decode_engine_line(line)
        if ev is not None:
            self._event(ev, main)

    def _event(self, ev: protocol.EngineEvent, main: bool) -> None:
        rs = self.state.ranks.get(ev.rank)
        if rs is None:
            if len(self.state.ranks) >= RANKS_KEPT:
                self.state.dropped_rank_events += 1
                return
            rs = self.state.ranks[ev.rank] = RankState(ev.rank)
        rs.node = ev.node if ev.node is not None else rs.node
        rs.world_size = ev.world_size if ev.world_size is not None else rs.world_size
        if isinstance(ev, StepEvent):
            if rs.first_step_t is None:
                rs.first_step_t = ev.t if ev.t is not None else time.time()
                self._check_first_step()
            rs.last_step = ev.step
            if main or self.state.last_step is None:
                self.state.last_step = ev.step  # the node's first rank speaks for the run (ranks agree on steps)
            self.state.last_step_at = ev.t
        elif isinstance(ev, StageEvent):
            if main or self.state.stage is None:
                self.state.stage = ev.stage
            if ev.stage == "distributed":
                rs.pid = ev.pid if ev.pid is not None else rs.pid
                rs.local_world_size = ev.local_world_size if ev.local_world_size is not None else rs.local_world_size
        elif isinstance(ev, ThreadErrorEvent):
            self.state.dropped_thread_errors += keep_thread_error(self.state.thread_errors, ev)
            keep_thread_error(rs.thread_errors, ev)
        elif isinstance(ev, RunEndEvent):
            rs.run_end = ev
            if main or self.state.run_end is None:
                self.state.run_end = ev
        elif isinstance(ev, ExportEvent):
            self.state.last_export = ev.path

    def _check_first_step(self) -> None:
        # first-step: every rank of this node has stepped (a rank that has not would be the one stuck).
        firsts = [r.first_step_t for r in self.state.ranks.values() if r.first_step_t is not None]
        if self.state.first_step_t is None and len(firsts) >= self.state.ranks_expected():
            self.state.first_step_t = max(firsts)


def keep_thread_error(kept: list[ThreadErrorEvent], ev: ThreadErrorEvent) -> int:
    """Append ``ev``, keeping at most THREAD_ERRORS_KEPT: the first few and the newest. How many were dropped (0, 1)."""
    kept.append(ev)
    if len(kept) <= THREAD_ERRORS_KEPT:
        return 0
    del kept[THREAD_ERRORS_FIRST_KEPT]  # the oldest of the newest
    return 1


def nproc_per_node(command: list[str]) -> int | None:
    """--nproc-per-node N of a torchrun command line (its number only: ``auto``/``gpu`` say nothing here)."""
    for i, arg in enumerate(command):
        value: str | None = None
        if _NPROC_RE.match(arg):
            value = arg.split("=", 1)[1] if "=" in arg else (command[i + 1] if i + 1 < len(command) else None)
        if value is not None and value.isdigit():
            return int(value)
    return None


class ScannerCache:
    """One incremental scanner per run directory and wrapper start, owned by whoever reads runs repeatedly (the
    agent, one wait): each read then scans only what was appended since the last. Thread-safe."""

    MAX_RUNS = 64  # beyond, start over (a scanner costs its ranks' state; an agent rarely sees this many runs)

    def __init__(self) -> None:
        self._scanners: dict[str, tuple[float | None, RunScanner]] = {}
        self._lock = threading.Lock()

    def scanner_for(self, run_dir: Path, launch: LaunchRecord) -> RunScanner:
        key = str(run_dir)
        with self._lock:
            cached = self._scanners.get(key)
            if cached is not None and cached[0] == launch.started_at:
                return cached[1]
            sc = new_scanner(run_dir, launch)
            if len(self._scanners) > self.MAX_RUNS:
                self._scanners.clear()
            self._scanners[key] = (launch.started_at, sc)
            return sc


def new_scanner(run_dir: Path, launch: LaunchRecord) -> RunScanner:
    """A scanner of one run from the start of its job's output."""
    return RunScanner(run_dir, launch.step_pattern, launch.output_offset_at_start, nproc_per_node(launch.command))
