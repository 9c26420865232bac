"""The ``wait`` verb: watch a run's records and the process table until a milestone, an exit, or a deadline."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from engine import protocol
from engine.host import procs
from engine.host.holders import find_holders
from engine.protocol import ThreadErrorEvent
from engine.supervisor import records
from engine.supervisor.common import POLL_S, SupervisorError, tree_of
from engine.supervisor.records import ExitRecord, LaunchRecord, SubmittedRecord

LAST_LINES = 20
STARTING_CHECK_S = 0.5  # while no launch.json exists, how often to ask tmux whether the pane died


def describe_activity(pids: Iterable[int], sample_s: float = 0.2) -> str:
    """What a live run is doing, in a phrase: processes, thread names, CPU, kernel wait, GPU devices."""
    pid_list = sorted(set(pids))
    if not pid_list:
        return "no live process"
    before = {p: procs.read_stat(p) for p in pid_list}
    time.sleep(sample_s)  # CPU use needs two samples
    after = {p: procs.read_stat(p) for p in pid_list}
    clk = os.sysconf("SC_CLK_TCK")
    cpu = 0.0
    threads = 0
    names: dict[str, int] = {}
    waits: set[str] = set()
    for p in pid_list:
        a, b = before.get(p), after.get(p)
        if a is None or b is None:
            continue
        cpu += 100.0 * (b.cpu_ticks - a.cpu_ticks) / clk / sample_s
        threads += b.num_threads
        for th in procs.threads_of(p):
            names[th.name] = names.get(th.name, 0) + 1
        wchan = procs.wait_channel(p)
        if wchan:
            waits.add(wchan)
    name_part = ", ".join(f"{n}×{c}" if c > 1 else n for n, c in sorted(names.items())[:8])
    parts = [
        f"{len(pid_list)} process{'es' if len(pid_list) != 1 else ''}",
        f"{threads} thread{'s' if threads != 1 else ''} ({name_part})" if name_part else f"{threads} threads",
        f"{cpu:.1f}% CPU",
    ]
    if waits:
        parts.append("waiting in " + ", ".join(sorted(waits)[:4]))
    try:
        holders = [h for h in find_holders(run_pids=set(pid_list)) if h.pid in set(pid_list)]
    except OSError:
        holders = []
    gpus = sorted({g for h in holders for g in h.gpus})
    if holders:
        parts.append(f"holds GPU {', '.join(map(str, gpus))}" if gpus else "holds NVIDIA control devices only")
    else:
        parts.append("no GPU device open")
    return "; ".join(parts)


def _deadline_for(milestone: str, deadlines: dict[str, float]) -> float | None:
    value = deadlines.get(milestone)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def wait_for(
    run_dir: Path | str,
    milestone: str,
    timeout_s: float | None,
    deadlines: dict[str, float] | None = None,
    boot_id: str | None = None,
    on_milestone: Callable[[str, float], None] | None = None,
    cancel: threading.Event | None = None,
    scanners: records.ScannerCache | None = None,
) -> protocol.WaitResult:
    """Watch the run directory and the process table until `milestone`, an exit, or a deadline.

    The process exiting ends the wait within one poll (~50 ms) with its exit code or signal and the
    last lines of output.log. A deadline passing with the process alive ends it as hung, saying
    what the process is doing. timeout_s counts from now; deadlines (milestone -> s) from submission.
    """
    if milestone not in protocol.MILESTONES:
        raise SupervisorError(f"unknown milestone {milestone!r}; milestones: {list(protocol.MILESTONES)}")
    rd = Path(run_dir)
    boot = boot_id or procs.read_boot_id()
    cache = scanners if scanners is not None else records.ScannerCache()  # each poll scans only what was appended
    t0 = time.monotonic()
    wall0 = time.time()
    reported: set[str] = set()
    sub = records.read_submitted(rd)
    dl = _deadlines(deadlines, sub)
    next_pane_check = t0 + STARTING_CHECK_S
    result = functools.partial(_result, rd, milestone, t0)
    while True:
        info = records.read_run(rd, boot, cache)
        _report_milestones(info, reported, on_milestone)
        if info.milestones.get(milestone) is not None:
            return result(True, info, None, info.state == "running")
        if info.state in ("exited", "failed", "stopped", "vanished", "rebooted"):
            return result(False, info, _end_cause(rd, info, milestone), False)
        if info.state == "running":
            died = _thread_death(rd, info, cache)
            if died is not None:
                return result(False, info, died[0], True, died[1])
        now_m = time.monotonic()
        if info.state == "starting" and now_m >= next_pane_check:
            next_pane_check = now_m + STARTING_CHECK_S
            pane_note = records.pane_note(sub or records.read_submitted(rd) or SubmittedRecord())
            if pane_note is not None and records.read_launch(rd) is None:
                info.state = "vanished"
                return result(False, info, f"the wrapper never started: {pane_note}", False)
        overdue = _overdue(info, milestone, dl, wall0)
        if overdue is None and timeout_s is not None and now_m - t0 >= timeout_s:
            overdue = f"{milestone} not reached within the {timeout_s:g} s timeout"
        if overdue is not None:
            return _hung(rd, info, milestone, overdue, result)
        if cancel is not None and cancel.is_set():
            return result(False, info, "wait cancelled", info.state == "running")
        time.sleep(POLL_S)


def _deadlines(given: dict[str, float] | None, sub: SubmittedRecord | None) -> dict[str, float]:
    """The deadlines given, else those of the run's launch spec (milestone -> s after submission)."""
    if given:
        return dict(given)
    spec = (sub.spec if sub is not None else None) or {}
    return dict(spec.get("deadlines_s") or {})


def _report_milestones(
    info: protocol.RunInfo, reported: set[str], on_milestone: Callable[[str, float], None] | None
) -> None:
    """Each milestone reached, once, in order, to ``on_milestone``."""
    for m in protocol.MILESTONES:
        t_m = info.milestones.get(m)
        if t_m is not None and m not in reported:
            reported.add(m)
            if on_milestone is not None:
                on_milestone(m, t_m)


def _thread_death(rd: Path, info: protocol.RunInfo, cache: records.ScannerCache) -> tuple[str, str | None] | None:
    """(cause, traceback) of a running run's thread that died of its own error, with no restart to come; else None.
    Names the rank that failed on ``info``."""
    launch_rec = records.read_launch(rd)
    scan = cache.scanner_for(rd, launch_rec).state if launch_rec is not None else None
    errors = _this_attempts(scan.thread_errors, launch_rec) if scan is not None else []
    # A peer's failure that a rank only saw is no cause: torchrun ends the run within seconds, naming the rank.
    own = [e for e in errors if e.exc_type != records.PEER_FAILURE]
    if not own or _may_restart(info):
        return None
    err = own[0]
    where = f"rank {err.rank} (node {err.node}): " if err.rank is not None else ""
    if where:
        info.failed_rank, info.failed_node = err.rank, err.node
    return f"{where}thread {err.thread} died: {err.exc_type}: {err.message}", err.traceback or None


def _overdue(info: protocol.RunInfo, milestone: str, deadlines: dict[str, float], wall0: float) -> str | None:
    """The first deadline passed of the milestones up to ``milestone`` that are not reached yet, in words."""
    submitted_at = info.milestones.get("submitted") or wall0
    for m in protocol.MILESTONES[: protocol.MILESTONES.index(milestone) + 1]:
        d = _deadline_for(m, deadlines)
        if d is not None and info.milestones.get(m) is None and time.time() > submitted_at + d:
            return f"{m} deadline of {d:g} s after submission passed"
    return None


def _result(
    rd: Path,
    milestone: str,
    t0: float,
    ok: bool,
    info: protocol.RunInfo,
    cause: str | None,
    alive: bool | None,
    detail: str | None = None,
    hung: bool = False,
) -> protocol.WaitResult:
    """The wait's answer: where the run got to, why it ended (``cause``) and, unless ``ok``, its last lines."""
    reached = [m for m in protocol.MILESTONES if info.milestones.get(m) is not None]
    stage = reached[-1] if reached else "none"
    if info.stage and reached and reached[-1] == "output":
        stage = info.stage  # the engine's own stages sit between output and first-step
    return protocol.WaitResult(
        ok=ok,
        milestone=milestone,
        stage=stage,
        cause=cause,
        exit_code=info.exit_code,
        signal=info.signal,
        elapsed_s=round(time.monotonic() - t0, 3),
        last_lines=[] if ok else _failed_lines(rd, info),
        alive=alive,
        detail=detail,
        run_id=info.run_id,
        hung=hung,
    )


def _may_restart(info: protocol.RunInfo) -> bool:
    """Under a restart policy with restarts left, a dead thread ends the process and the wrapper starts it again:
    the wait goes on through the restart instead of failing on the first attempt's error."""
    if info.restart_max is None:
        return False
    return info.restart_state == "backoff" or (
        info.restart_state == "watching" and len(info.restarts) < info.restart_max
    )


def _this_attempts(events: list[ThreadErrorEvent], launch_rec: LaunchRecord | None) -> list[ThreadErrorEvent]:
    """The events of the current attempt (a restarted run's earlier attempts wrote theirs to the same file)."""
    since = launch_rec.attempt_started_at if launch_rec is not None else None
    if since is None or launch_rec is None or launch_rec.attempt in (None, 1):
        return events
    return [e for e in events if e.t is None or e.t >= since]


def _failed_lines(rd: Path, info: protocol.RunInfo) -> list[str]:
    """The last lines of the rank that failed (its own, from output.log) when a torchrun rank was named, else the
    log's last lines."""
    log = rd / records.OUTPUT_LOG
    if info.failed_rank is not None:
        own = records.rank_last_lines(log, info.failed_rank, LAST_LINES)
        if own:
            return own
    return records.last_lines(log, LAST_LINES)


def _end_cause(rd: Path, info: protocol.RunInfo, milestone: str) -> str:
    exit_rec = records.read_exit(rd) or ExitRecord()
    before = f"before {milestone}"
    if info.cause:
        return info.cause
    if info.state == "rebooted":
        return f"the host rebooted since the run started ({before})"
    if info.state == "vanished":
        return f"the run's processes are gone and left no exit record ({before}): killed with the wrapper?"
    recorded = exit_rec.cause
    if info.signal is not None:
        return f"killed by signal {info.signal} ({records.signal_name(info.signal)}) {before}"
    if recorded and not str(recorded).startswith("exited with code"):
        return f"{recorded} (exit code {info.exit_code})"
    return f"exited with code {info.exit_code} {before}"


def output_elsewhere(rd: Path, pids: list[int]) -> str | None:
    """Where a silent job writes instead of output.log (a script's ``exec > other.log``), from its processes'
    stdout and stderr descriptors: "FILE (stdout of pid P)"; None when they name output.log or nothing readable
    (a pipe or a terminal the job set up itself is named too: its words go there)."""
    ours = os.path.realpath(rd / records.OUTPUT_LOG)
    for pid in pids:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = procs.fd_target(pid, fd)
            if target is None or target == ours or target.removesuffix(" (deleted)") == ours:
                continue
            return f"{target} ({name} of pid {pid})"
    return None


def _hung(rd: Path, info: protocol.RunInfo, milestone: str, overdue: str, result: Any) -> protocol.WaitResult:
    if info.state == "starting":
        note = records.pane_note(records.read_submitted(rd) or SubmittedRecord())
        if note is not None:
            return result(False, info, f"not started: {overdue}; no launch.json; {note}", False)
        # The wrapper's session is still there but it has not written its record: stuck before the job.
        return result(False, info, f"hung: {overdue}; the wrapper has not written launch.json yet", True, None, True)
    launch_rec = records.read_launch(rd)
    pids = records.run_pids(launch_rec)
    job_pid = launch_rec.job_pid if launch_rec is not None else None
    job_pids = set(tree_of(job_pid))
    activity = describe_activity(job_pids or pids)
    output_t = info.milestones.get("output")
    if output_t is None:
        state_txt = "alive, silent"
        since = f"no output in {time.time() - (info.started_at or time.time()):.1f} s"
        elsewhere = output_elsewhere(rd, sorted(job_pids))
        if elsewhere:
            state_txt += f" here; its output goes to {elsewhere}"
    else:
        state_txt = "alive, no step yet" if milestone == "first-step" else "alive"
        try:
            last_write = os.stat(rd / records.OUTPUT_LOG).st_mtime
            since = f"last output {time.time() - last_write:.1f} s ago"
        except OSError:
            since = "output log unreadable"
        if info.stage:
            since += f"; engine stage {info.stage}"
    detail = f"{state_txt}: {since}; {activity}"
    cause = f"hung: {overdue}; process {state_txt}"
    return result(False, info, cause, True, detail, True)
