"""Run records on the host: run ids, the run directory layout, atomic JSON records, and reading a run back.

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
        events.jsonl              the engine's structured events
        restarts.json             under a restart policy: each restart's attempt, cause, time and exit (restart.py)
        events.jsonl              the engine's structured events (under torchrun: local rank 0 of this node)
        events.rank<R>.jsonl      the events of global rank R, another rank of this node
        checkpoints/              the engine's checkpoints

Stdlib only: this module runs on hosts that have nothing but python3.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import protocol
from engine.host import appended, procs
from engine.host.appended import AppendedFile
from engine.host.runs import ExitRecord, LaunchRecord, SubmittedRecord
from engine.protocol import validate_run_id
from engine.supervisor import tmux
from engine.supervisor.failure import Failure, FailureScan, last_step_in

RUNS_DIR = "runs"
CURRENT_LINK = "current"
SUBMITTED_JSON = "submitted.json"
SPEC_JSON = "spec.json"
LAUNCH_JSON = "launch.json"
MILESTONES_JSON = "milestones.json"
EXIT_JSON = "exit.json"
EXIT_RESERVED = ".exit.reserved"  # the exit record's blocks, allocated at launch (a full disk cannot lose the exit)
EXIT_RESERVE_BYTES = 16 * 1024
OUTPUT_LOG = "output.log"
EVENTS_JSONL = "events.jsonl"
RESTARTS_JSON = "restarts.json"  # engine/supervisor/restart.py writes it through the wrapper
CHECKPOINTS_DIR = "checkpoints"

# Bytes of output.log / events.jsonl one read_run call scans at most (status must never stall on a huge log).
_SCAN_BUDGET_BYTES = 8 * 1024 * 1024
LOG_LINE_MAX_BYTES = 64 * 1024  # a log "line" longer than this without an end is scanned as it is
_KIND_RE = re.compile(rb'"kind"\s*:\s*"([a-z_]+)"')
_SCANNED_KINDS = frozenset({b"step", b"stage", b"thread_error", b"run_end", b"export"})
# Events only a running engine writes about its own progress: a job that writes them takes first-step from them
# (not from the step pattern); an error event alone (a job that died before training) does not make it an engine.
_PROGRESS_KINDS = frozenset({b"stage", b"heartbeat", b"step"})




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


def write_json_atomic(path: Path | str, obj: Any, mode: int = 0o644) -> None:
    """Write JSON so a reader sees the old file or the complete new one, never half (tmp + fsync + rename)."""
    target = Path(path)
    data = (json.dumps(protocol.to_jsonable(obj), indent=1, sort_keys=True) + "\n").encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    try:
        dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is atomic
    finally:
        os.close(dfd)


def reserve_exit_record(run_dir: Path | str) -> bool:
    """Allocate the exit record's space now (a padded placeholder, fsynced), so the record survives a full disk.

    False when even that cannot be written (the disk is full already): the exit is then recorded only if there
    is room when the job ends.
    """
    path = Path(run_dir) / EXIT_RESERVED
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:
        return False
    try:
        view = memoryview(b" " * (EXIT_RESERVE_BYTES - 1) + b"\n")
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        return False
    os.close(fd)
    return True


def write_exit_record(run_dir: Path | str, exit_rec: ExitRecord) -> None:
    """Write exit.json atomically; when the disk is full, into the space reserve_exit_record took, renamed."""
    rd = Path(run_dir)
    rec = exit_rec.to_json()
    try:
        write_json_atomic(rd / EXIT_JSON, rec)
    except OSError:
        if not _fill_reserved_exit(rd, rec):
            raise
    else:
        (rd / EXIT_RESERVED).unlink(missing_ok=True)


def _fill_reserved_exit(rd: Path, rec: dict[str, Any]) -> bool:
    """Overwrite the reserved blocks in place (no new blocks needed), then rename them to exit.json."""
    path = rd / EXIT_RESERVED
    fit = dict(rec)
    data = json.dumps(protocol.to_jsonable(fit), sort_keys=True).encode()
    if len(data) >= EXIT_RESERVE_BYTES:
        fit["forwarded_signals"] = (fit.get("forwarded_signals") or [])[:4]
        fit["cause"] = str(fit.get("cause") or "")[:1000]
        data = json.dumps(protocol.to_jsonable(fit), sort_keys=True).encode()
    if len(data) >= EXIT_RESERVE_BYTES:
        return False
    padded = data + b" " * (EXIT_RESERVE_BYTES - 1 - len(data)) + b"\n"  # the same size: JSON ignores the spaces
    try:
        fd = os.open(path, os.O_WRONLY)  # no O_TRUNC: the blocks stay allocated
    except OSError:
        return False
    try:
        view = memoryview(padded)
        offset = 0
        while offset < len(padded):
            offset += os.pwrite(fd, view[offset:], offset)
        os.fsync(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        os.replace(path, rd / EXIT_JSON)
    except OSError:
        return False
    try:
        dfd = os.open(rd, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return True


def read_json(path: Path | str) -> dict[str, Any] | None:
    """A JSON object from a file; None when missing or not (yet) a JSON object."""
    try:
        with open(path, "rb") as fh:
            obj = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def last_lines(path: Path | str, n: int = 20, max_bytes: int = 64 * 1024) -> list[str]:
    """The last n lines of a file (decoded as UTF-8 with replacement, CRLF read as a line end); [] when missing."""
    try:
        tail = appended.last_lines(path, n, block_bytes=max_bytes, max_bytes=max_bytes)
    except OSError:
        return []
    lines = tail.lines[1:] if tail.starts_mid_line else tail.lines  # the first line was cut by the window
    ended = len(lines) - (1 if tail.partial else 0)  # lines followed by a newline: a CR before it is part of the end
    return [
        (line[:-1] if i < ended and line.endswith(b"\r") else line).decode("utf-8", "replace")
        for i, line in enumerate(lines)
    ]


RANK_EVENTS_RE = re.compile(r"events\.rank(\d+)\.jsonl")
_PEER_RE = re.compile(r"peer rank (\d+) \(node (\d+)")
_LISTED_PEER_RE = re.compile(r"rank (\d+) \(node (\d+)")
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
    thread_errors: list[dict[str, Any]] = field(default_factory=list)
    run_end: dict[str, Any] | None = None

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
    thread_errors: list[dict[str, Any]] = field(default_factory=list)
    run_end: dict[str, Any] | None = None
    last_export: str | None = None  # OUT_DIR of the newest `specdec-train export` event
    log_last_step: int | None = None  # the number in the last output.log line matching the step pattern
    failure: Failure = field(default_factory=Failure)  # exceptions and torchrun's root cause in output.log
    engine_events: bool = False  # the job writes engine events: first-step comes from them, not the step pattern
    ranks: dict[int | None, RankState] = field(default_factory=dict)
    nproc_hint: int | None = None  # --nproc-per-node of a torchrun command line, when the events do not say

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
            names += sorted(e for e in os.listdir(self.run_dir) if RANK_EVENTS_RE.fullmatch(e))
        except OSError:
            return
        for name in names:
            self._poll_events_file(name, self._ev.setdefault(name, AppendedFile(self.run_dir / name)), budget)

    def _poll_events_file(self, name: str, tail: AppendedFile, budget: int) -> None:
        st, _ = tail.check()
        if st is None or st.st_size <= tail.position:
            return
        data = tail.read_path(min(budget, st.st_size - tail.position))
        _, complete = tail.take_complete(data)
        for line in complete.split(b"\n")[:-1]:
            self._event_line(line, name == EVENTS_JSONL)

    def _event_line(self, line: bytes, main: bool = True) -> None:
        """One event; ``main``: from events.jsonl, whose rank (this node's first) speaks for the run."""
        # Heartbeats are the bulk of the file and change nothing here: skip them before parsing.
        m = _KIND_RE.search(line)
        if m is None:
            return
        if m.group(1) in _PROGRESS_KINDS:
            self.state.engine_events = True
        if m.group(1) not in _SCANNED_KINDS:
            return
        try:
            ev = json.loads(line)
        except ValueError:
            return
        if not isinstance(ev, dict):
            return
        kind = ev.get("kind")
        t = ev.get("t")
        t_f = float(t) if isinstance(t, (int, float)) else None
        rank = ev.get("rank") if isinstance(ev.get("rank"), int) else None
        rs = self.state.ranks.get(rank)
        if rs is None:
            rs = self.state.ranks[rank] = RankState(rank)
        if isinstance(ev.get("node"), int):
            rs.node = ev["node"]
        if isinstance(ev.get("world_size"), int):
            rs.world_size = ev["world_size"]
        if kind == "step":
            if rs.first_step_t is None:
                rs.first_step_t = t_f if t_f is not None else time.time()
                self._check_first_step()
            step = ev.get("step")
            if isinstance(step, int):
                rs.last_step = step
                if main or self.state.last_step is None:
                    self.state.last_step = step  # the node's first rank speaks for the run (ranks agree on steps)
            self.state.last_step_at = t_f
        elif kind == "stage":
            stage = ev.get("stage")
            if isinstance(stage, str) and (main or self.state.stage is None):
                self.state.stage = stage
            if stage == "distributed":
                rs.pid = ev.get("pid") if isinstance(ev.get("pid"), int) else rs.pid
                lws = ev.get("local_world_size")
                rs.local_world_size = lws if isinstance(lws, int) else rs.local_world_size
        elif kind == "thread_error":
            self.state.thread_errors.append(ev)
            rs.thread_errors.append(ev)
        elif kind == "run_end":
            rs.run_end = ev
            if main or self.state.run_end is None:
                self.state.run_end = ev
        elif kind == "export":
            path = ev.get("path")
            if isinstance(path, str):
                self.state.last_export = path

    def _check_first_step(self) -> None:
        # first-step: every rank of this node has stepped (a rank that has not would be the one stuck).
        firsts = [r.first_step_t for r in self.state.ranks.values() if r.first_step_t is not None]
        if self.state.first_step_t is None and len(firsts) >= self.state.ranks_expected():
            self.state.first_step_t = max(firsts)


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


def read_launch(run_dir: Path | str) -> LaunchRecord | None:
    return LaunchRecord.read(Path(run_dir) / LAUNCH_JSON)


def read_exit(run_dir: Path | str) -> ExitRecord | None:
    return ExitRecord.read(Path(run_dir) / EXIT_JSON)


def read_submitted(run_dir: Path | str) -> SubmittedRecord | None:
    return SubmittedRecord.read(Path(run_dir) / SUBMITTED_JSON)


def read_milestones(run_dir: Path, launch: LaunchRecord | None, scan: ScanState | None) -> dict[str, float | None]:
    """milestone -> unix time reached (None: not reached), from the records and what a scan saw."""
    sub = read_submitted(run_dir) or SubmittedRecord()
    ms = read_json(run_dir / MILESTONES_JSON) or {}
    out: dict[str, float | None] = dict.fromkeys(protocol.MILESTONES)
    out["submitted"] = sub.t
    if launch is not None:
        out["started"] = launch.job_started_at  # the job itself exists, not only its wrapper
        if out["submitted"] is None:
            out["submitted"] = launch.started_at
    out["output"] = ms.get("output")
    out["first-step"] = ms.get("first-step")
    if scan is not None:
        if out["output"] is None and scan.output_seen_at is not None:
            out["output"] = _output_time(run_dir, scan.output_seen_at)
        if out["first-step"] is None:
            out["first-step"] = scan.first_step_t or scan.log_step_seen_at
    if out["started"] is None:
        out["output"] = out["first-step"] = None  # words in output.log before a job exists are the wrapper's
    # Times come from different clocks (a coarse file mtime, an engine's own "t"): keep them in milestone order.
    prev: float | None = None
    for m in protocol.MILESTONES:
        t = out[m]
        if t is not None:
            if prev is not None and t < prev:
                out[m] = prev
            prev = out[m]
    return out


def _output_time(run_dir: Path, seen_at: float) -> float:
    # The wrapper was not there to time it: the log's mtime is the best bound we have.
    try:
        return min(seen_at, os.stat(run_dir / OUTPUT_LOG).st_mtime)
    except OSError:
        return seen_at


def pane_note(launch_sub: SubmittedRecord) -> str | None:
    """Why a wrapper never wrote launch.json, as tmux (or, without tmux, the process table) saw it."""
    session = launch_sub.tmux_session
    if not session:
        pid = launch_sub.launcher_wrapper_pid
        if pid is not None and not procs.process_alive(pid, launch_sub.launcher_wrapper_start_ticks):
            return f"the wrapper (pid {pid}, started with setsid) exited"
        return None
    state = tmux.pane_state(session)
    deadline = time.monotonic() + 2.0
    while state is not None and state["dead"] and state["dead_status"] is None and state["dead_signal"] is None:
        # Dead pty, child not reaped yet (or its SIGCHLD lost by tmux): have the server reap, then read again.
        if time.monotonic() > deadline:
            return f"the tmux pane of session {session} exited (tmux recorded no exit status)"
        tmux.reap_children()
        state = tmux.pane_state(session)
        if state is not None and state["dead"] and state["dead_status"] is None and state["dead_signal"] is None:
            time.sleep(0.05)
    if state is None:
        return f"tmux session {session} is gone"
    if state["dead"]:
        if state["dead_signal"] is not None:
            sig = int(state["dead_signal"])
            return f"the tmux pane of session {session} was killed by signal {sig} ({signal_name(sig)})"
        return f"the tmux pane of session {session} exited with status {state['dead_status']}"
    return None


# How long after submission a run whose launcher is gone may still be taken up by tmux or setsid (tmux's own
# command timeout, with its retries, bounds how long a tmux client of a vanished agent can still create the session).
STARTING_GRACE_S = 15.0


def never_started_cause(sub: SubmittedRecord, now: float | None = None) -> str | None:
    """Why a submitted run that has no launch.json will never start; None while its wrapper may still write one."""
    session = sub.tmux_session
    if sub.phase == "submitting":
        lpid = sub.launcher_pid
        if procs.process_alive(lpid, sub.launcher_start_ticks):
            return None  # the agent is still inside the launch
        if session and tmux.has_session(session):
            return pane_note(sub)  # tmux took it before the agent went
        t = sub.t
        if t is not None and (now if now is not None else time.time()) - t < STARTING_GRACE_S:
            return None
        how = f"tmux accepted session {session}" if session else "it started the wrapper with setsid"
        return f"the agent (pid {lpid}) that launched it exited before {how}"
    return pane_note(sub)


def read_run(run_dir: Path | str, boot_id: str, scanners: ScannerCache | None = None) -> protocol.RunInfo:
    """The run as its records and the process table say it is now.

    ``scanners``: the caller's cache, so that repeated reads scan only what was appended; without one the run's
    output is scanned afresh (bounded), and nothing outlives the call.
    """
    rd = Path(run_dir)
    launch = read_launch(rd)
    exit_rec = read_exit(rd)
    info = protocol.RunInfo(run_id=rd.name, run_dir=str(rd), state="starting")
    sub = read_submitted(rd)
    never: str | None = None
    if launch is None and exit_rec is None and sub is not None:
        never = never_started_cause(sub)
        if never is not None:  # the wrapper may have written its records while we asked: read them again
            launch = read_launch(rd)
            exit_rec = read_exit(rd)
            if launch is not None or exit_rec is not None:
                never = None
    sub = sub or SubmittedRecord()
    spec: dict[str, Any] = sub.spec or {}
    info.command = list(spec.get("command") or [])
    info.cwd = spec.get("cwd")
    info.tmux_session = sub.tmux_session
    info.attachable = sub.attachable
    info.profile = spec.get("profile")
    scan: ScanState | None = None
    if launch is not None:
        info.command = list(launch.command or info.command)
        # launch.json's word wins where it has one; what it lacks, submitted.json says.
        info.cwd = launch.cwd if launch.cwd is not None else info.cwd
        info.pid = launch.job_pid or launch.wrapper_pid
        info.pgid = launch.job_pgid or launch.pgid
        info.boot_id = launch.boot_id
        info.started_at = launch.started_at
        info.tmux_session = launch.tmux_session if launch.tmux_session is not None else info.tmux_session
        info.attachable = launch.attachable  # the wrapper always writes it (copied from submitted.json)
        info.profile = launch.profile if launch.profile is not None else info.profile
        scanner = scanners.scanner_for(rd, launch) if scanners is not None else new_scanner(rd, launch)
        scan = scanner.catch_up() if exit_rec is not None else scanner.poll()
        info.stage = scan.stage
        info.last_step = scan.last_step if scan.last_step is not None else scan.log_last_step
        info.last_step_at = scan.last_step_at
        info.last_export = scan.last_export
        blamed = rank_failure(scan)
        if blamed is not None:
            info.failed_rank, info.failed_node = blamed.rank, blamed.node
    if exit_rec is None and launch is not None:
        if launch.boot_id not in (None, boot_id):
            info.state = "rebooted"
        elif launch.wrapper_alive() or launch.job_alive():
            info.state = "running"
        else:
            exit_rec = read_exit(rd)  # the wrapper may have written it between our reads
            if exit_rec is None:
                info.state = "vanished"
    if never is not None:
        info.state = "failed"
        info.cause = f"the wrapper never started: {never}"
    if exit_rec is not None:
        info.exit_code = exit_rec.exit_code
        info.signal = exit_rec.signal
        info.ended_at = exit_rec.ended_at
        info.state = "exited" if info.exit_code == 0 and info.signal is None else "failed"
        if info.state == "failed" and info.cause is None:
            info.cause = failure_cause(scan, exit_rec, info.last_step)
    info.milestones = read_milestones(rd, launch, scan)
    _read_restarts(rd, info)
    return info


def _read_restarts(rd: Path, info: protocol.RunInfo) -> None:
    """The restart policy's record (restarts.json) into the run info: each restart, the policy's max, its state."""
    doc = read_json(rd / RESTARTS_JSON)
    if doc is None:
        return
    restarts = doc.get("restarts")
    info.restarts = [r for r in restarts if isinstance(r, dict)] if isinstance(restarts, list) else []
    policy = doc.get("policy")
    max_restarts = policy.get("max") if isinstance(policy, dict) else None
    info.restart_max = max_restarts if isinstance(max_restarts, int) else None
    state = doc.get("state")
    info.restart_state = state if isinstance(state, str) else None


ROOT_CAUSE_KEY = "root_cause"  # exit.json: the wrapper's word on the last attempt's own root cause


def root_cause(scan: ScanState, since: float | None = None) -> str | None:
    """What failed, in the run's own words: the failing rank (torchrun), else the log's root exception or first
    error line (a full disk first), else the first engine thread error (at or after ``since``, the attempt's
    start, when given); None when nothing names it."""
    blamed = rank_failure(scan)
    if blamed is not None:
        return blamed.text
    named = scan.failure.describe()
    if named:
        return named
    errors = [
        e for e in scan.thread_errors if since is None or not isinstance(e.get("t"), (int, float)) or e["t"] >= since
    ]
    if errors:
        first = errors[0]
        return f"engine thread {first.get('thread')}: {first.get('exc_type')}: {first.get('message')}"
    return None


def failure_cause(scan: ScanState | None, exit_rec: ExitRecord, last_step: int | None) -> str:
    """A failed run's cause: the root exception (torchrun: the failing rank and its exception), else what the wrapper
    recorded; then how the job ended and its last step. After restarts the wrapper's record of the last attempt's
    own cause wins: the log holds every attempt's words, the first attempt's first."""
    parts: list[str] = []
    recorded = exit_rec.cause
    recorded_root = exit_rec.extra.get(ROOT_CAUSE_KEY)
    recorded_root = recorded_root if isinstance(recorded_root, str) and recorded_root else None
    restarted = (exit_rec.attempts or 1) > 1
    own = root_cause(scan) if scan is not None and not restarted else None
    if restarted and recorded_root is not None:
        parts.append(recorded_root)
    elif own:
        parts.append(own)
    elif recorded_root is not None:
        parts.append(recorded_root)  # e.g. the disk filled before the job could write why
    elif isinstance(recorded, str) and recorded and not recorded.startswith("exited with code"):
        parts.append(recorded)
    signum, exit_code = exit_rec.signal, exit_rec.exit_code
    if signum is not None:
        parts.append(f"killed by signal {signum} ({signal_name(signum)})")
    elif exit_code is not None:
        parts.append(f"exit code {exit_code}")
    parts.append(f"last step {last_step}" if last_step is not None else "no step reached")
    return "; ".join(parts)


@dataclass(frozen=True)
class RankFailure:
    text: str  # "rank 1 (node 0) killed by SIGKILL", "rank 1 (node 0): thread drafter0: RuntimeError: boom"
    rank: int | None
    node: int | None


_REASON_CHARS = 400
PEER_FAILURE = "PeerFailure"  # the engine's exception for "a peer rank failed or left": a consequence, not a cause


def _short(text: str) -> str:
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 1] + "…"


def _own_error(rs: RankState) -> str | None:
    """What a rank's own events say failed in it (not a peer's failure it only saw)."""
    for err in rs.thread_errors:
        if err.get("exc_type") != PEER_FAILURE:
            return f"thread {err.get('thread')}: {err.get('exc_type')}: {_short(str(err.get('message')))}"
    end = rs.run_end
    reason = str((end or {}).get("reason") or "")
    if end is not None and not end.get("ok") and PEER_FAILURE not in reason and _peer_in(reason) is None:
        return _short(reason)
    return None


def _peer_in(text: str) -> tuple[int, int] | None:
    """(rank, node) of the peer a PeerFailure message blames: "peer rank 1 (node 1, host pid 7) is gone", or the
    only one listed in "a peer failed or timed out ...; peers: rank 1 (node 1, host)"."""
    m = _PEER_RE.search(text)
    if m is not None:
        return int(m.group(1)), int(m.group(2))
    listed = text.split("; peers: ", 1)[1] if "; peers: " in text else ""
    found = _LISTED_PEER_RE.findall(listed.split(":", 1)[0])
    return (int(found[0][0]), int(found[0][1])) if len(found) == 1 else None


def _blamed_peer(rs: RankState) -> tuple[int, int, str] | None:
    """(peer rank, its node, what this rank said) when this rank ended because a peer failed or went away."""
    texts = [str((rs.run_end or {}).get("reason") or "")] + [str(e.get("message") or "") for e in rs.thread_errors]
    for text in texts:
        peer = _peer_in(text)
        if peer is not None:
            return peer[0], peer[1], text
    return None


def rank_failure(scan: ScanState) -> RankFailure | None:
    """The rank of a torchrun run that failed first and why: torchrun's root cause names the rank (and its signal
    or exit code), the rank's own events say why; a rank that only saw a peer go (the killed node's agent, on
    another host) names that peer. None for a run that is not torchrun's or where no rank failed."""
    if not scan.distributed():
        return None
    f = scan.failure
    if f.root_rank is not None:
        rs = scan.ranks.get(f.root_rank) or RankState(f.root_rank)
        peer = _blamed_peer(rs)
        if peer is not None and _own_error(rs) is None:
            return _peer_failure(rs, peer)
        code = f.root_exitcode
        if code is not None and code < 0:
            return RankFailure(f"{rs.label()} killed by {signal_name(-code)}", rs.rank, rs.node)
        own = _own_error(rs)
        if own is not None:
            return RankFailure(f"{rs.label()}: {own}", rs.rank, rs.node)
        how = f" exited with code {code}" if code is not None else " failed"
        return RankFailure(f"{rs.label()}{how}" + (f": {f.root_detail}" if f.root_detail else ""), rs.rank, rs.node)
    ended = sorted(
        (
            r
            for r in scan.ranks.values()
            if r.rank is not None and (r.thread_errors or (r.run_end or {}).get("ok") is False)
        ),
        key=lambda r: r.rank or 0,
    )
    for rs in ended:  # a rank that failed on its own first
        own = _own_error(rs)
        if own is not None:
            return RankFailure(f"{rs.label()}: {own}", rs.rank, rs.node)
    for rs in ended:
        peer = _blamed_peer(rs)
        if peer is not None:
            return _peer_failure(rs, peer)
    return None


def _peer_failure(rs: RankState, peer: tuple[int, int, str]) -> RankFailure:
    rank, node, said = peer
    return RankFailure(
        f"rank {rank} (node {node}) failed or left the run; {rs.label()} said: {_short(said)}", rank, node
    )


def rank_last_lines(path: Path | str, rank: int, n: int = 20) -> list[str]:
    """The last n lines of output.log that rank ``rank`` wrote: ranks above 0 prefix theirs ``[rank R] ``; rank 0's
    carry no prefix (they share that with torchrun's own). [] when the log holds none of them."""
    lines = last_lines(path, 4000, 1024 * 1024)
    if rank > 0:
        tag = f"[rank {rank}] "
        return [ln for ln in lines if ln.startswith(tag)][-n:]
    return [ln for ln in lines if not ln.startswith("[rank ")][-n:]


def list_runs(run_root: Path | str) -> list[Path]:
    """Run directories, oldest first (by name: generated ids sort by time)."""
    try:
        entries = sorted(runs_dir(run_root).iterdir(), key=lambda p: (p.stat().st_mtime, p.name))
    except OSError:
        return []
    return [p for p in entries if p.is_dir()]
