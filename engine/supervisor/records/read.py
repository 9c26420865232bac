"""Reading a run back: its records, its scan and the process table joined into the RunInfo the agent reports, and
the last lines of its log.

Stdlib only: this module runs on hosts that have nothing but python3.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from engine import protocol
from engine.host import appended
from engine.supervisor.records.cause import failure_cause, never_started_cause, rank_failure
from engine.supervisor.records.documents import (
    LaunchRecord,
    SubmittedRecord,
    read_exit,
    read_json,
    read_launch,
    read_submitted,
)
from engine.supervisor.records.layout import MILESTONES_JSON, OUTPUT_LOG, RESTARTS_JSON, oldest_first, runs_dir
from engine.supervisor.records.scanner import ScannerCache, ScanState, new_scanner


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
    info.output_dir = engine_output_dir(rd)
    info.tmux_session = sub.tmux_session
    info.attachable = sub.attachable
    info.profile = spec.get("profile")
    info.nnodes, info.node_rank = _nodes_of(spec)
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
        info.events_unread_bytes = scan.skipped_event_bytes
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
        # Asked to stop and it ended on it cleanly (an engine that checkpoints on SIGTERM exits 0; records
        # written before that case was named say only stop_requested): no failure to name, and not "exited".
        if exit_rec.stopped or (info.state == "exited" and exit_rec.stop_requested is not None):
            info.state = "stopped"
            info.cause = exit_rec.cause if exit_rec.stopped else "stopped: exited with code 0"
            info.failed_rank = info.failed_node = None
        if info.state == "failed" and info.cause is None:
            info.cause = failure_cause(scan, exit_rec, info.last_step)
    info.milestones = read_milestones(rd, launch, scan)
    _read_restarts(rd, info)
    return info


def unended_runs(run_root: Path | str, ended: set[str] | None = None) -> list[Path]:
    """The run directories with no exit record yet (starting, running, or gone without writing one), oldest first.
    ``ended``: a caller's cache of the run ids known to have ended (an exit record never goes away), filled here, so
    a caller asking every few seconds reads only the runs not yet ended."""
    ended = ended if ended is not None else set()
    try:
        entries = [p for p in runs_dir(run_root).iterdir() if p.name not in ended and p.is_dir()]
    except OSError:
        return []
    out = []
    for rd in entries:
        if read_exit(rd) is not None:
            ended.add(rd.name)
        else:
            out.append(rd)
    return oldest_first(out)


def _nodes_of(spec: dict[str, Any]) -> tuple[int | None, int | None]:
    """(nodes, this node's rank) of a run launched over several nodes, as its recorded environment says."""
    env = spec.get("env")
    if not isinstance(env, dict):
        return None, None
    words = [env.get(protocol.ENV_NNODES), env.get(protocol.ENV_NODE_RANK)]
    nnodes, rank = (
        int(w) if isinstance(w, str) and w.isascii() and w.isdigit() and len(w) < 7 else None for w in words
    )
    if nnodes is None or rank is None or not rank < nnodes:
        return None, None
    return nnodes, rank


def engine_output_dir(run_dir: Path) -> str | None:
    """The engine's output directory: <run dir>/checkpoints is the engine's link to <output_dir>/checkpoints."""
    try:
        target = Path(os.readlink(run_dir / "checkpoints"))
    except OSError:
        return None
    if not target.is_absolute():
        target = run_dir / target
    return str(target.parent) if target.name == "checkpoints" else None


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


def rank_last_lines(path: Path | str, rank: int, n: int = 20) -> list[str]:
    """The last n lines of output.log that rank ``rank`` wrote: ranks above 0 prefix theirs ``[rank R] ``; rank 0's
    carry no prefix (they share that with torchrun's own). [] when the log holds none of them."""
    lines = last_lines(path, 4000, 1024 * 1024)
    if rank > 0:
        tag = f"[rank {rank}] "
        return [ln for ln in lines if ln.startswith(tag)][-n:]
    return [ln for ln in lines if not ln.startswith("[rank ")][-n:]
