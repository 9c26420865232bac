"""Start, watch, stop and inspect supervised runs; clean up stale GPU holders.

Everything here acts only on what the run records name (pid, process group, each checked against
its recorded start time) or on processes that hold an NVIDIA device right now, re-checked by
(pid, create_time) before every signal. Nothing is ever matched by name.

Stdlib only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import engine
from engine import protocol, stackdump
from engine.host import procs, runs
from engine.host.holders import find_holders
from engine.host.runs import ExitRecord, LaunchRecord, SubmittedRecord
from engine.supervisor import records, restart, tmux

POLL_S = 0.05
LAST_LINES = 20
STARTING_CHECK_S = 0.5  # while no launch.json exists, how often to ask tmux whether the pane died
KILL_WAIT_S = 5.0  # after SIGKILL, how long a process may take to leave the table

Progress = Callable[[str], None]


class SupervisorError(Exception):
    """A request that cannot be carried out; the message is a sentence for the user."""


def _noop(_: str) -> None:
    return None


# -- launch ------------------------------------------------------------------------------------


def coerce_spec(raw: protocol.LaunchSpec | dict[str, Any]) -> protocol.LaunchSpec:
    """A validated LaunchSpec from the wire (unknown keys refused, types checked)."""
    if isinstance(raw, protocol.LaunchSpec):
        data = asdict(raw)
    elif isinstance(raw, dict):
        data = dict(raw)
    else:
        raise SupervisorError("launch needs an object of LaunchSpec fields")
    known = set(protocol.LaunchSpec.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise SupervisorError(f"unknown launch fields {unknown}; known: {sorted(known)}")
    command = data.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise SupervisorError("launch needs a command: a non-empty list of strings (argv, never a shell line)")
    if not command[0]:
        raise SupervisorError("the command's first word is empty")
    env = data.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise SupervisorError("env must map strings to strings")
    if any(not k or "=" in k or "\0" in k for k in env):
        raise SupervisorError("env names must be non-empty and contain neither '=' nor NUL")
    deadlines = data.get("deadlines_s") or {}
    if not isinstance(deadlines, dict):
        raise SupervisorError("deadlines_s must map milestones to seconds")
    for name, value in deadlines.items():
        if name not in protocol.MILESTONES:
            raise SupervisorError(f"unknown milestone {name!r} in deadlines_s; milestones: {list(protocol.MILESTONES)}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise SupervisorError(f"deadline for {name!r} must be a positive number of seconds")
    pattern = data.get("step_pattern") or r"step=\d+"
    try:
        re.compile(pattern.encode())
    except (re.error, AttributeError) as exc:
        raise SupervisorError(f"step_pattern {pattern!r} is not a valid regular expression: {exc}") from exc
    run_id = data.get("run_id")
    if run_id is not None:
        try:
            records.validate_run_id(run_id)
        except records.RunIdError as exc:
            raise SupervisorError(str(exc)) from exc
    cwd = data.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise SupervisorError("cwd must be a string")
    profile = data.get("profile")
    policy: dict[str, Any] | None = None
    if data.get("restart") is not None:
        try:
            policy = restart.parse_policy(data["restart"]).as_dict()
        except restart.PolicyError as exc:
            raise SupervisorError(f"launch field {exc}") from exc
    return protocol.LaunchSpec(
        command=list(command),
        cwd=cwd,
        env=dict(env),
        run_id=run_id,
        step_pattern=pattern,
        deadlines_s={k: float(v) for k, v in deadlines.items()},
        profile=profile if isinstance(profile, str) else None,
        restart=policy,
    )


def check_run_root(run_root: Path) -> Path:
    """Create <run_root>/runs and prove we can write there (os.access lies for root on read-only mounts)."""
    runs = records.runs_dir(run_root)
    try:
        runs.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=runs)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename else ""
        raise SupervisorError(f"run root {run_root} is not writable: {reason}{where}") from exc
    return runs


def _engine_root() -> str:
    # The directory holding the `engine` package: the wrapper is started from there with `python3 -m`.
    return str(Path(engine.__file__).resolve().parent.parent)


def _reap_in_background(proc: subprocess.Popen[bytes]) -> None:
    threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()


def _claim_run_id(root: Path, wanted: str | None, use_tmux: bool) -> tuple[str, Path, str | None]:
    """Create the run directory for a free run id (and tmux session name); a generated id is redrawn on a clash."""
    for _ in range(5 if wanted is None else 1):
        run_id = wanted or records.new_run_id()
        run_dir = records.run_dir_for(root, run_id)
        session = tmux.session_name(run_id) if use_tmux else None
        if session is not None and tmux.has_session(session):
            if wanted is None:
                continue
            raise SupervisorError(
                f"tmux session {session!r} already exists (run id {run_id!r} clashes with it); pick another run id, "
                f"or end that session with: {shlex.join(tmux.base_argv())} kill-session -t ={session}"
            )
        try:
            run_dir.mkdir()
        except FileExistsError as exc:
            if wanted is None:
                continue
            raise SupervisorError(f"run {run_id!r} already exists at {run_dir}; pick another run id") from exc
        except OSError as exc:
            raise SupervisorError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from exc
        return run_id, run_dir, session
    raise SupervisorError("could not find a free run id after 5 tries; pass one with run_id")


def launch(spec_in: protocol.LaunchSpec | dict[str, Any], run_root: Path | str) -> dict[str, Any]:
    """Start the wrapper for a run; returns once tmux (or setsid) accepted it (the `submitted` milestone).

    Every reason not to start is an error with a sentence, never a silent non-start.
    """
    spec = coerce_spec(spec_in)
    root = Path(run_root).expanduser()
    check_run_root(root)
    cwd = os.path.expanduser(spec.cwd) if spec.cwd else os.path.expanduser("~")
    if not os.path.isabs(cwd):
        raise SupervisorError(f"working directory {cwd!r} must be an absolute path on the host")
    if not os.path.isdir(cwd):
        what = "is not a directory" if os.path.exists(cwd) else "does not exist"
        raise SupervisorError(f"working directory {cwd} {what} on the host")
    spec.cwd = cwd
    use_tmux = tmux.available()
    run_id, run_dir, session = _claim_run_id(root, spec.run_id, use_tmux)
    spec.run_id = run_id
    doc = {"spec": asdict(spec), "run_id": run_id, "tmux_session": session, "attachable": use_tmux}
    spec_path = run_dir / records.SPEC_JSON
    records.write_json_atomic(spec_path, doc, mode=0o600)
    argv = [
        sys.executable,
        "-m",
        "engine.supervisor.wrapper",
        "--run-dir",
        str(run_dir),
        "--spec-json",
        str(spec_path),
    ]
    note = None if session is not None else "tmux is not available on the host: started with setsid; not attachable"
    sub_doc = SubmittedRecord(
        t=time.time(),
        phase="submitting",  # "accepted" once tmux (or setsid) took the wrapper
        run_id=run_id,
        tmux_session=session,
        attachable=session is not None,
        tmux_socket=os.environ.get(tmux.SOCKET_ENV),
        launcher_pid=os.getpid(),
        launcher_start_ticks=procs.start_ticks_of(os.getpid()),
        spec=asdict(spec),
        note=note,
    )
    # The run is visible (submitted.json, current) before its job can exist: whatever ends this process from here
    # on, `status` shows the run, starting, then running or why it never started.
    previous = _current_link(root)
    try:
        records.write_json_atomic(run_dir / records.SUBMITTED_JSON, sub_doc.to_json(), mode=0o600)
        records.set_current(root, run_dir)
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        _restore_current(root, previous)
        raise SupervisorError(f"could not record run {run_id} in {run_dir}: {exc.strerror or exc}") from exc
    wrapper_pid: int | None = None
    wrapper_ticks: int | None = None
    try:
        if session is not None:
            shell = f"cd {shlex.quote(_engine_root())} && exec {shlex.join([*argv, '--echo-to-pane'])}"
            tmux.new_session(session, shell, cwd)
        else:
            proc = subprocess.Popen(
                argv,
                cwd=_engine_root(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,  # no controlling terminal: a closing SSH or pct channel cannot reach it
            )
            wrapper_pid = proc.pid
            wrapper_ticks = procs.start_ticks_of(proc.pid)
            _reap_in_background(proc)
    except (tmux.TmuxError, OSError, subprocess.SubprocessError) as exc:
        # Nothing started: leave no husk of a run that never was, and the previous run current again.
        _restore_current(root, previous)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise SupervisorError(f"could not start run {run_id}: {exc}") from exc
    submitted_at = time.time()
    sub_doc.t, sub_doc.phase = submitted_at, "accepted"
    sub_doc.launcher_wrapper_pid, sub_doc.launcher_wrapper_start_ticks = wrapper_pid, wrapper_ticks
    with contextlib.suppress(OSError):  # the run is recorded already; a full disk here only loses the wrapper pid
        records.write_json_atomic(run_dir / records.SUBMITTED_JSON, sub_doc.to_json(), mode=0o600)
    return {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "tmux_session": session,
        "attachable": session is not None,
        "attach": tmux.attach_command(session) if session is not None else None,
        "submitted_at": submitted_at,
        "note": note,
    }


def _current_link(root: Path) -> str | None:
    try:
        return os.readlink(root / records.CURRENT_LINK)
    except OSError:
        return None


def _restore_current(root: Path, previous: str | None) -> None:
    """Point <run_root>/current back where it pointed before a launch that did not happen."""
    with contextlib.suppress(OSError):
        if previous is None:
            (root / records.CURRENT_LINK).unlink(missing_ok=True)
        else:
            records.set_current(root, Path(previous) if os.path.isabs(previous) else root / previous)


def spec_of(run_dir: Path | str) -> dict[str, Any]:
    """The LaunchSpec a run was started with (for restart)."""
    rd = Path(run_dir)
    for name in (records.LAUNCH_JSON, records.SUBMITTED_JSON, records.SPEC_JSON):
        doc = records.read_json(rd / name)
        if doc is not None and isinstance(doc.get("spec"), dict):
            return dict(doc["spec"])
    raise SupervisorError(f"run {rd.name} has no recorded launch spec")


# -- waiting for milestones --------------------------------------------------------------------


def _tree(pid: int | None) -> list[int]:
    return procs.tree_pids(pid) if pid else []


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
        try:
            wchan = Path(f"/proc/{p}/wchan").read_text().strip()
        except OSError:
            wchan = ""
        if wchan and wchan != "0":
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
    target_idx = protocol.MILESTONES.index(milestone)
    reported: set[str] = set()
    sub = records.read_submitted(rd)
    dl = dict(deadlines or {})
    if not dl:
        spec = (sub.spec if sub is not None else None) or {}
        dl = dict(spec.get("deadlines_s") or {})
    next_pane_check = t0 + STARTING_CHECK_S
    pane_note: str | None = None

    def result(
        ok: bool,
        info: protocol.RunInfo,
        cause: str | None,
        alive: bool | None,
        detail: str | None = None,
        hung: bool = False,
    ) -> protocol.WaitResult:
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

    while True:
        info = records.read_run(rd, boot, cache)
        for m in protocol.MILESTONES:
            t_m = info.milestones.get(m)
            if t_m is not None and m not in reported:
                reported.add(m)
                if on_milestone is not None:
                    on_milestone(m, t_m)
        if info.milestones.get(milestone) is not None:
            return result(True, info, None, info.state == "running")
        if info.state in ("exited", "failed", "vanished", "rebooted"):
            return result(False, info, _end_cause(rd, info, milestone), False)
        if info.state == "running":
            launch_rec = records.read_launch(rd)
            scan = cache.scanner_for(rd, launch_rec).state if launch_rec is not None else None
            errors = _this_attempts(scan.thread_errors, launch_rec) if scan is not None else []
            # A peer's failure that a rank only saw is no cause: torchrun ends the run within seconds, naming the rank.
            own = [e for e in errors if e.get("exc_type") != records.PEER_FAILURE]
            if own and not _may_restart(info):
                err = own[0]
                where = f"rank {err['rank']} (node {err.get('node')}): " if isinstance(err.get("rank"), int) else ""
                if where:
                    info.failed_rank, info.failed_node = err["rank"], err.get("node")
                return result(
                    False,
                    info,
                    f"{where}thread {err.get('thread')} died: {err.get('exc_type')}: {err.get('message')}",
                    True,
                    str(err.get("traceback") or "") or None,
                )
        now_m = time.monotonic()
        if info.state == "starting" and now_m >= next_pane_check:
            next_pane_check = now_m + STARTING_CHECK_S
            pane_note = records.pane_note(sub or records.read_submitted(rd) or SubmittedRecord())
            if pane_note is not None and records.read_launch(rd) is None:
                info.state = "vanished"
                return result(False, info, f"the wrapper never started: {pane_note}", False)
        submitted_at = info.milestones.get("submitted") or wall0
        overdue: str | None = None
        for m in protocol.MILESTONES[: target_idx + 1]:
            d = _deadline_for(m, dl)
            if d is not None and info.milestones.get(m) is None and time.time() > submitted_at + d:
                overdue = f"{m} deadline of {d:g} s after submission passed"
                break
        if overdue is None and timeout_s is not None and now_m - t0 >= timeout_s:
            overdue = f"{milestone} not reached within the {timeout_s:g} s timeout"
        if overdue is not None:
            return _hung(rd, info, milestone, overdue, result)
        if cancel is not None and cancel.is_set():
            return result(False, info, "wait cancelled", info.state == "running")
        time.sleep(POLL_S)


def _may_restart(info: protocol.RunInfo) -> bool:
    """Under a restart policy with restarts left, a dead thread ends the process and the wrapper starts it again:
    the wait goes on through the restart instead of failing on the first attempt's error."""
    if info.restart_max is None:
        return False
    return info.restart_state == "backoff" or (
        info.restart_state == "watching" and len(info.restarts) < info.restart_max
    )


def _this_attempts(events: list[dict[str, Any]], launch_rec: LaunchRecord | None) -> list[dict[str, Any]]:
    """The events of the current attempt (a restarted run's earlier attempts wrote theirs to the same file)."""
    since = launch_rec.attempt_started_at if launch_rec is not None else None
    if since is None or launch_rec is None or launch_rec.attempt in (None, 1):
        return events
    return [e for e in events if not isinstance(e.get("t"), (int, float)) or e["t"] >= since]


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


def _hung(rd: Path, info: protocol.RunInfo, milestone: str, overdue: str, result: Any) -> protocol.WaitResult:
    if info.state == "starting":
        note = records.pane_note(records.read_submitted(rd) or SubmittedRecord())
        if note is not None:
            return result(False, info, f"not started: {overdue}; no launch.json; {note}", False)
        # The wrapper's session is still there but it has not written its record: stuck before the job.
        return result(False, info, f"hung: {overdue}; the wrapper has not written launch.json yet", True, None, True)
    launch_rec = records.read_launch(rd)
    pids = runs.run_pids(launch_rec)
    job_pid = launch_rec.job_pid if launch_rec is not None else None
    job_pids = set(_tree(job_pid))
    activity = describe_activity(job_pids or pids)
    output_t = info.milestones.get("output")
    if output_t is None:
        state_txt = "alive, silent"
        since = f"no output in {time.time() - (info.started_at or time.time()):.1f} s"
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


# -- stop --------------------------------------------------------------------------------------


def stop(
    run_dir: Path | str,
    grace_s: float = 30.0,
    release_timeout_s: float = 30.0,
    progress: Progress = _noop,
    boot_id: str | None = None,
    scanners: records.ScannerCache | None = None,
) -> dict[str, Any]:
    """SIGTERM to the run's process group, wait the grace, SIGKILL, then wait (bounded) for its GPU devices to free."""
    rd = Path(run_dir)
    boot = boot_id or procs.read_boot_id()
    steps: list[str] = []

    def step(msg: str) -> None:
        steps.append(msg)
        progress(msg)

    launch_rec = records.read_launch(rd)
    if launch_rec is None:
        deadline = time.monotonic() + 2.0  # a run submitted a moment ago: give the wrapper its first breath
        while launch_rec is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            launch_rec = records.read_launch(rd)
        if launch_rec is None:
            raise SupervisorError(f"run {rd.name} has no launch record (it never started): nothing to stop")
    cache = scanners if scanners is not None else records.ScannerCache()
    info = records.read_run(rd, boot, cache)
    ours = runs.run_pids(launch_rec)
    held_before = _holders_among(ours)
    job_pid = launch_rec.job_pid
    job_ticks = launch_rec.job_start_ticks
    pgid = launch_rec.job_pgid
    # torchrun starts each rank in a session of its own: the group alone misses them, so the run's processes are
    # its group, the job's tree and the ranks its events name, each pinned by pid and start time from now on.
    members = run_members(rd, launch_rec, cache)
    if info.state != "running":
        if not members:
            raise SupervisorError(f"run {rd.name} is not running ({info.state}): nothing to stop")
        step(f"the job ended ({info.state}) but {len(members)} of its process(es) remain")
    wrapper_pid = launch_rec.wrapper_pid or 0
    wrapper_ticks = launch_rec.wrapper_start_ticks
    if _cancel_restarts(launch_rec, wrapper_pid, wrapper_ticks):
        step("restart policy cancelled: nothing is restarted after this stop")

    def alive_members() -> list[int]:
        # Processes started in the group since we listed it count only while the group is provably still ours.
        ours_now = isinstance(pgid, int) and group_is_ours(pgid, members)
        late = procs.group_members(pgid, None, job_ticks) if isinstance(pgid, int) and ours_now else []
        return sorted({pid for pid, ticks in members.items() if procs.process_alive(pid, ticks)} | set(late))

    def target_gone() -> bool:
        if members:
            return not alive_members()
        return not procs.process_alive(wrapper_pid, wrapper_ticks)

    if members:
        in_group = [p for p in members if isinstance(pgid, int) and _pgrp(p) == pgid]
        # A worker whose torchrun agent lives gets SIGTERM from it (one signal each: a second one while the first
        # is handled can deadlock a handler that logs); only an orphaned rank needs ours.
        outside = sorted(p for p in members if p not in in_group and _parent(p) not in in_group)
        forwarded = len(members) - len(in_group) - len(outside)
        what = f"process group {pgid}" if isinstance(pgid, int) else "the job"
        n = len(in_group)
        text = f"SIGTERM to {what} ({n} process{'es' if n != 1 else ''})"
        text += f" (torchrun forwards it to its {forwarded} worker(s))" if forwarded else ""
        text += f" and to {len(outside)} orphaned rank process(es) ({_pids_text(outside)})" if outside else ""
        step(text)
        if isinstance(pgid, int) and in_group:
            signal_group_checked(pgid, {p: members[p] for p in in_group}, signal.SIGTERM)
        for pid in outside:
            _kill_checked(pid, members[pid], signal.SIGTERM)
    else:
        if not procs.process_alive(wrapper_pid, wrapper_ticks):
            raise SupervisorError(f"run {rd.name}: neither its job nor its wrapper is alive: nothing to stop")
        if info.restart_state == "backoff":
            step(f"waiting to restart (backoff): SIGTERM to the wrapper (pid {wrapper_pid}) ends the run")
        else:
            step(f"job not started yet: SIGTERM to the wrapper (pid {wrapper_pid})")
        os.kill(wrapper_pid, signal.SIGTERM)
    t0 = time.monotonic()
    escalated = False
    if _wait_until(target_gone, grace_s):
        step(f"exited {time.monotonic() - t0:.1f} s after SIGTERM")
    else:
        escalated = True
        left = alive_members()
        step(f"still alive after the {grace_s:g} s grace ({len(left)} process(es)): SIGKILL to process group {pgid}")
        if isinstance(pgid, int) and left:
            signal_group_checked(pgid, members, signal.SIGKILL)
        for pid in left:
            if pid in members:
                _kill_checked(pid, members[pid], signal.SIGKILL)
        if _wait_until(target_gone, KILL_WAIT_S):
            step(f"killed: gone {time.monotonic() - t0:.1f} s after SIGTERM")
        else:
            stuck = alive_members()
            states = ", ".join(f"{p} ({_state(p)})" for p in stuck[:8])
            step(f"still present {KILL_WAIT_S:g} s after SIGKILL: {states} (uninterruptible sleep in the driver?)")
    t_rel = time.monotonic()
    released = _wait_until(lambda: not _holders_among(ours), release_timeout_s)
    holders_left = _holders_among(ours)
    if released and not held_before:
        step("no GPU device was held by the run")
    elif released:
        step(f"GPU devices released ({time.monotonic() - t_rel:.1f} s after the processes ended)")
    else:
        step(f"GPU devices still held after {release_timeout_s:g} s by pid(s) {', '.join(map(str, holders_left))}")
    _wait_until(lambda: (rd / records.EXIT_JSON).exists(), 3.0)
    exit_rec = records.read_exit(rd)
    if exit_rec is not None:
        step(f"exit record: {exit_rec.cause}")
    return {
        "stopped": not alive_members(),
        "escalated": escalated,
        "steps": steps,
        "run_id": rd.name,
        "job_pid": job_pid,
        "exit": exit_rec.to_json() if exit_rec is not None else None,
        "gpu_released": released,
    }


def _cancel_restarts(launch_rec: LaunchRecord, wrapper_pid: int, wrapper_ticks: int | None) -> bool:
    """Tell a wrapper that runs a restart policy to restart nothing more (before its job is signalled)."""
    spec = launch_rec.spec
    name = launch_rec.cancel_signal
    if spec is None or spec.get("restart") is None or name is None:
        return False  # no policy, or a wrapper from before restart policies: it would not know the signal
    try:
        sig = signal.Signals[name]
    except KeyError:
        return False
    if not procs.process_alive(wrapper_pid, wrapper_ticks):
        return False
    try:
        os.kill(wrapper_pid, sig)
    except ProcessLookupError:
        return False
    return True


def rank_pids(rd: Path, launch_rec: LaunchRecord, scanners: records.ScannerCache | None = None) -> dict[int, int]:
    """global rank -> pid of this node's torchrun ranks, from their ``distributed`` stage events."""
    scanner = scanners.scanner_for(rd, launch_rec) if scanners is not None else records.new_scanner(rd, launch_rec)
    ranks = scanner.poll().ranks
    return {r.rank: r.pid for r in ranks.values() if r.rank is not None and r.pid is not None}


def _runs_in(pid: int, rd: Path) -> bool:
    """The process was started for this run: its environment names this run directory (a reused pid's does not)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    names = {f"{protocol.ENV_RUN_DIR}={p}".encode() for p in (rd, os.path.realpath(rd))}  # the wrapper resolves it
    return any(entry in names for entry in env)


def run_members(rd: Path, launch_rec: LaunchRecord, scanners: records.ScannerCache | None = None) -> dict[int, int]:
    """pid -> start ticks of every live process of the run: the job's group, torchrun's workers (it starts each in a
    session of its own) and this node's ranks as their events name them (a rank outlives a killed agent until it
    notices)."""
    table = procs.all_stats()
    job_ticks = launch_rec.job_start_ticks
    pids: set[int] = set()
    pgid = launch_rec.job_pgid
    if pgid is not None:
        pids.update(procs.group_members(pgid, table, job_ticks))
    job_pid = launch_rec.job_pid
    job = table.get(job_pid) if job_pid is not None else None
    if job is not None and (job_ticks is None or job.start_ticks == job_ticks) and _is_torchrun(launch_rec):
        # Its workers, each in a session of its own (any other process that left the group is only reported).
        agents = {job.pid} | {p for p in procs.tree_pids(job.pid, table) if table[p].pgrp == pgid}
        workers = [st.pid for st in table.values() if st.ppid in agents and st.pgrp != pgid]
        for pid in workers:
            pids.update(procs.tree_pids(pid, table))
    for pid in rank_pids(rd, launch_rec, scanners).values():
        st = table.get(pid)
        if st is not None and (job_ticks is None or st.start_ticks >= job_ticks) and _runs_in(pid, rd):
            pids.update(procs.tree_pids(pid, table))
    return {
        pid: table[pid].start_ticks for pid in sorted(pids) if pid in table and table[pid].state not in ("Z", "X", "x")
    }


TORCHRUN_PROGRAMS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def _is_torchrun(launch_rec: LaunchRecord) -> bool:
    """The job is torchrun (directly, or through env/python -m): its workers are the run's, in sessions of their own."""
    command = launch_rec.command
    return any(os.path.basename(a) in TORCHRUN_PROGRAMS for a in command[:8])


def _parent(pid: int) -> int | None:
    st = procs.read_stat(pid)
    return st.ppid if st is not None else None


def _pgrp(pid: int) -> int | None:
    st = procs.read_stat(pid)
    return st.pgrp if st is not None else None


def _pids_text(pids: list[int]) -> str:
    return ", ".join(map(str, pids[:8])) + (f" and {len(pids) - 8} more" if len(pids) > 8 else "")


def _kill_checked(pid: int, start_ticks: int, sig: int) -> None:
    # Only the very process we listed (pid and start time): a pid reused since is left alone.
    if procs.process_alive(pid, start_ticks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _killpg(pgid: int, sig: int) -> None:
    # The group may have emptied between our check and the signal: that is what we wanted.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_is_ours(pgid: int, pinned: dict[int, int]) -> bool:
    """A process we pinned (pid and start ticks) is still alive in the group: while it lives the group id cannot
    have been reused, so signalling the group reaches only the run's processes."""
    return any(procs.process_alive(pid, ticks) and _pgrp(pid) == pgid for pid, ticks in pinned.items())


def signal_group_checked(pgid: int, pinned: dict[int, int], sig: int) -> bool:
    """``sig`` to the group when it is still ours, else to each pinned process still alive; True for the group."""
    if group_is_ours(pgid, pinned):
        _killpg(pgid, sig)
        return True
    for pid, ticks in pinned.items():
        _kill_checked(pid, ticks, sig)
    return False


def _state(pid: int) -> str:
    st = procs.read_stat(pid)
    return procs.state_name(st.state) if st is not None else "gone"


def _wait_until(cond: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + max(0.0, timeout_s)
    while True:
        if cond():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)


def _holders_among(pids: set[int]) -> list[int]:
    if not pids:
        return []
    return [h.pid for h in find_holders(run_pids=pids) if h.pid in pids and _state(h.pid) != "zombie"]


# -- kill stale GPU holders ----------------------------------------------------------------------


def current_run_pids(run_root: Path | str) -> set[int]:
    rd = records.current_run_dir(run_root)
    if rd is None:
        return set()
    return runs.run_pids(records.read_launch(rd))


def _protected_pids() -> set[int]:
    """This agent and its ancestors: never candidates (the agent may hold /dev/nvidiactl for NVML)."""
    out: set[int] = set()
    pid = os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        st = procs.read_stat(pid)
        if st is None:
            break
        pid = st.ppid
    return out


@dataclass
class NvmlView:
    """What the GPU source says about processes: pid -> MiB used and pid -> GPU indices (host PIDs)."""

    pid_used_mib: dict[int, float] = field(default_factory=dict)
    pid_gpus: dict[int, list[int]] = field(default_factory=dict)
    source: str = "nvml"  # "nvml" | "simulated"
    pid_gpu_mib: dict[int, dict[int, float | None]] = field(default_factory=dict)
    listed: bool = False  # every GPU's process list was read
    host_map: protocol.HostMap | None = None  # under --pct: the Proxmox host's NVML, mapped into this container
    gpus: list[protocol.GpuInfo] = field(default_factory=list)  # this side's GPUs (the host map matches UUIDs)


def _foreign_owner(pid: int) -> str | None:
    """The owner's name when the process is not (wholly) ours, i.e. its real or effective uid is not our euid.

    kill-stale signals only the agent's own user's processes (as nvitop does): on a shared box, an agent
    running as root must not end a colleague's job that happens to hold a GPU.
    """
    uids = procs.uids_of(pid)
    me = os.geteuid()
    if uids is not None and uids[0] == me and uids[1] == me:
        return None
    return procs.user_of(pid) or (str(uids[0]) if uids is not None else "unknown (its status is unreadable)")


def _foreign_reason(owner: str) -> str:
    return f"owned by user {owner}; kill-stale only signals your own processes"


def stale_candidates(
    run_root: Path | str, nvml: NvmlView | None = None
) -> tuple[list[protocol.HolderInfo], list[protocol.HolderInfo]]:
    """(candidates, left alone): our user's holders of an NVIDIA device outside the current run, and the rest."""
    candidates, others = _classify(run_root, nvml)
    return candidates, [h for h, _ in others]


def _classify(
    run_root: Path | str, nvml: NvmlView | None
) -> tuple[list[protocol.HolderInfo], list[tuple[protocol.HolderInfo, str]]]:
    ours = current_run_pids(run_root)
    protected = _protected_pids()
    view = nvml or NvmlView()
    candidates: list[protocol.HolderInfo] = []
    others: list[tuple[protocol.HolderInfo, str]] = []
    found = find_holders(
        procs.default_dev_dir(),
        nvml_pids=view.pid_used_mib,
        run_pids=ours,
        nvml_pid_gpus=view.pid_gpus,
        nvml_source=view.source,
        nvml_pid_gpu_mib=view.pid_gpu_mib,
        nvml_listed=view.listed,
        host_map=view.host_map,
        local_gpus=view.gpus,
    )
    for h in found:
        reason = _left_alone_reason(h, ours, protected)
        if reason is None:
            candidates.append(h)
        else:
            others.append((h, reason))
    return candidates, others


def _left_alone_reason(h: protocol.HolderInfo, ours: set[int], protected: set[int]) -> str | None:
    """Why a holder is never a kill-stale candidate; None when it is one."""
    if h.scope != "here":
        where = f"container {h.container}" if h.scope == "container" else "the Proxmox host"
        return f"runs in {where} (host pid {h.host_pid}, seen from the host): never signalled from this container"
    if h.in_run or h.pid in ours:
        return "part of the current run"
    if not h.resolved:
        return "NVML reports this PID but it is not visible here (another PID namespace)"
    if h.pid in protected:
        return "this agent or its parent"
    owner = _foreign_owner(h.pid)
    if owner is not None:
        return _foreign_reason(owner)
    if h.context is False:
        return "holds a device handle but no GPU context (a monitor such as nvidia-smi or nvitop); frees nothing"
    if procs.is_system_holder(h):
        return "a driver daemon or monitor that holds the device by design"
    return None


def kill_stale(
    run_root: Path | str,
    dry_run: bool = True,
    targets: list[list[float]] | list[tuple[int, float]] | None = None,
    grace_s: float = 10.0,
    progress: Progress = _noop,
    nvml: NvmlView | None = None,
) -> dict[str, Any]:
    """List (dry run) or signal the stale GPU holders, each by PID after re-checking (pid, create_time).

    Holders come from /proc/*/fd links to <dev>/nvidia* (what works inside a container) plus, when
    given, the GPU source's process list (NVML, or the simulated source under --simulate-gpus).
    """
    candidates, others = _classify(run_root, nvml)
    result: dict[str, Any] = {
        "candidates": candidates,
        "left_alone": [{"holder": h, "reason": reason} for h, reason in others],
        "signalled": [],
        "failed": [],
        "dry_run": dry_run,
    }
    if dry_run:
        return result
    by_pid = {h.pid: h for h in candidates}
    # Each chosen holder with the create time every later check compares against: the target's own, as listed.
    chosen: list[tuple[protocol.HolderInfo, float | None]] = []
    failed: list[dict[str, Any]] = result["failed"]
    if targets is None:
        chosen = [(h, h.create_time) for h in candidates]
    else:
        for item in targets:
            if (
                not isinstance(item, (list, tuple))
                or len(item) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in item)
            ):
                raise SupervisorError(f"targets must be [pid, create_time] number pairs; got {item!r}")
            pid, ct = int(item[0]), float(item[1])
            h = by_pid.get(pid)
            if h is not None and h.create_time is not None and _same_tick(h.create_time, ct):
                chosen.append((h, ct))
                continue
            failed.append({"pid": pid, "create_time": ct, "reason": _why_not_candidate(pid, ct, others)})
    pending: list[dict[str, Any]] = []
    for h, ct_listed in chosen:
        entry: dict[str, Any] = {
            "pid": h.pid,
            "create_time": ct_listed,
            "user": h.user,
            "cmd": h.cmd,
            "signals": [],
        }
        err = _signal_checked(h.pid, ct_listed, signal.SIGTERM)
        if err is not None:
            failed.append({**entry, "reason": err})
            progress(f"pid {h.pid}: not signalled: {err}")
            continue
        entry["signals"].append("SIGTERM")
        progress(f"SIGTERM to pid {h.pid} ({h.user}: {(h.cmd or '')[:80]})")
        pending.append(entry)
    t0 = time.monotonic()
    _wait_until(lambda: all(not _same_alive(e["pid"], e["create_time"]) for e in pending), grace_s if pending else 0)
    for e in pending:
        if not _same_alive(e["pid"], e["create_time"]):
            e["outcome"] = f"exited {time.monotonic() - t0:.1f} s after SIGTERM"
            continue
        err = _signal_checked(e["pid"], e["create_time"], signal.SIGKILL)
        if err is not None:
            e["outcome"] = f"SIGKILL not sent: {err}"
            continue
        e["signals"].append("SIGKILL")
        progress(f"pid {e['pid']} still alive after {grace_s:g} s: SIGKILL")
    killed = [e for e in pending if "SIGKILL" in e["signals"]]
    _wait_until(lambda: all(not _same_alive(e["pid"], e["create_time"]) for e in killed), KILL_WAIT_S if killed else 0)
    for e in pending:
        if "outcome" in e:
            continue
        if _same_alive(e["pid"], e["create_time"]):
            e["outcome"] = f"still alive {KILL_WAIT_S:g} s after SIGKILL (state {_state(e['pid'])})"
            failed.append({**e, "reason": e["outcome"]})
        else:
            e["outcome"] = "killed by SIGKILL after the grace"
    result["signalled"] = pending
    for e in pending:
        progress(f"pid {e['pid']}: {e['outcome']}")
    return result


_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _same_tick(a: float, b: float) -> bool:
    """Two create times name the same start: /proc start times are whole clock ticks (1/SC_CLK_TCK, 10 ms), so
    anything beyond float noise (half a tick) is another start, e.g. a PID reused one tick later."""
    return abs(a - b) < 0.5 / _HZ


def _same_alive(pid: int, create_time: float | None) -> bool:
    if create_time is None:
        return False
    st = procs.read_stat(pid)
    if st is None or st.state in ("Z", "X", "x"):
        return False
    return _same_tick(procs.create_time_of(st), create_time)


def _signal_checked(pid: int, create_time: float | None, sig: int) -> str | None:
    """Send sig to pid only if it is still the listed process (same start tick) and ours; the reason when not."""
    if create_time is None or not procs.same_process(pid, create_time, 0.49 / _HZ):
        return "no longer the process that was listed (exited, or its PID was reused): not touched"
    owner = _foreign_owner(pid)
    if owner is not None:
        return f"not signalled: {_foreign_reason(owner)}"
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return "exited before the signal"
    except PermissionError:
        return f"permission denied (EPERM): owned by {procs.user_of(pid) or 'another user'}; run as that user or root"
    except OSError as exc:
        return f"{errno.errorcode.get(exc.errno or 0, 'error')}: {exc.strerror}"
    return None


def _why_not_candidate(pid: int, create_time: float, others: list[tuple[protocol.HolderInfo, str]]) -> str:
    ident = procs.proc_identity(pid)
    if ident is None:
        return "no such process (already exited)"
    if not _same_tick(ident[1], create_time):
        return "its PID now belongs to another process (create time differs): not touched"
    for h, reason in others:
        if h.pid == pid:
            return f"not a stale holder: {reason}"
    return "holds no NVIDIA device: never touched by kill-stale"


# -- stacks ------------------------------------------------------------------------------------


def _catches(pid: int, sig: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def _is_python(pid: int) -> bool:
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        exe = ""
    return exe.startswith("python") or exe.startswith("pypy")


# How long the named (Python-level) dump may take before faulthandler's unnamed one stands in: a thread
# that holds the GIL (a long C call) keeps Python handlers from running, never faulthandler.
NAMED_DUMP_WAIT_S = 0.75
DUMP_POLL_S = 0.01


def _dump_engine(rd: Path, pid: int) -> tuple[str, str]:
    """(how, text) of one engine process that registered engine.stackdump: the named dump, else faulthandler's."""
    files = stackdump.dump_files(rd, pid)
    try:
        before = files.text.stat().st_ino
    except OSError:
        before = None
    try:
        raw_start = files.raw.stat().st_size
    except OSError:
        raw_start = 0  # removed by hand since the engine started: only the named dump can answer
    os.kill(pid, stackdump.SIGNAL)
    deadline = time.monotonic() + NAMED_DUMP_WAIT_S
    while True:
        try:
            st = files.text.stat()
            if st.st_ino != before:
                text = files.text.read_text(encoding="utf-8", errors="replace")
                if text.rstrip().endswith(stackdump.END_MARKER):
                    return "named threads", text
        except OSError:
            pass
        if time.monotonic() >= deadline:
            break
        time.sleep(DUMP_POLL_S)
    try:
        with open(files.raw, "rb") as fh:  # faulthandler wrote in the signal handler itself: complete by now
            fh.seek(raw_start)
            raw = fh.read().decode("utf-8", "replace")
    except OSError:
        raw = ""
    if not raw.strip():
        raise SupervisorError(f"pid {pid} wrote no stack dump to {files.text.parent} within {NAMED_DUMP_WAIT_S:g} s")
    why = f"no named dump within {NAMED_DUMP_WAIT_S:g} s: Python code cannot run, a thread holds the GIL"
    return f"faulthandler, threads unnamed ({why})", raw


def stacks(
    run_dir: Path | str,
    timeout_s: float = 5.0,
    boot_id: str | None = None,
    scanners: records.ScannerCache | None = None,
) -> dict[str, Any]:
    """Every thread's stack of the live run.

    Our engine (it registered engine.stackdump): SIGUSR1, named threads from its own dump file in well under
    a second. Any other Python job: py-spy when installed; else, when the job handles SIGUSR1 (faulthandler
    to its stderr, as before), the dump read back from output.log, labelled as such (log lines may be mixed
    in, and it waits for the log to go quiet); else why not.
    """
    rd = Path(run_dir)
    cache = scanners if scanners is not None else records.ScannerCache()
    info = records.read_run(rd, boot_id or procs.read_boot_id(), cache)
    if info.state != "running":
        raise SupervisorError(f"run {rd.name} is not running ({info.state}): no stacks to dump")
    launch_rec = records.read_launch(rd) or LaunchRecord()
    job_pid = launch_rec.job_pid
    pids = _tree(job_pid) if isinstance(job_pid, int) else []
    if not pids:
        raise SupervisorError(f"run {rd.name}: the job process is gone")
    # torchrun's ranks: in the job's tree while their agent lives, and named with their pid by their events.
    pids = sorted(set(pids) | set(run_members(rd, launch_rec, cache)))
    rank_of = {pid: rank for rank, pid in rank_pids(rd, launch_rec, cache).items()}
    py_pids = [p for p in pids if _is_python(p)]
    engines = [p for p in py_pids if stackdump.dump_files(rd, p).raw.exists() and _catches(p, stackdump.SIGNAL)]
    engines.sort(key=lambda p: (rank_of.get(p, -1), p))
    if engines:
        texts: list[str] = []
        hows: list[str] = []
        for pid in engines:
            how, text = _dump_engine(rd, pid)
            hows.append(how)
            who = f"rank {rank_of[pid]}, pid {pid}" if pid in rank_of else f"pid {pid}"
            texts.append(f"--- {who} ({procs.cmdline_of(pid)[:100]}) ---\n{text}")
        pids_text = ", ".join(map(str, engines))
        return {
            "method": f"SIGUSR1 to pid {pids_text}: {'; '.join(sorted(set(hows)))}",
            "text": "\n".join(texts),
            "ranks": {str(rank_of[p]): p for p in engines if p in rank_of},
        }
    if not py_pids:
        names = ", ".join(f"{p} ({procs.cmdline_of(p)[:60]})" for p in pids[:5])
        raise SupervisorError(f"no Python process in the run ({names}): no Python stacks to dump")
    pyspy = shutil.which("py-spy")
    if pyspy is not None:
        texts = []
        for pid in py_pids:
            res = subprocess.run(
                [pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s + 10, check=False
            )
            texts.append(f"--- pid {pid} (py-spy dump, exit {res.returncode}) ---\n{res.stdout}{res.stderr}")
        return {"method": "py-spy dump", "text": "\n".join(texts)}
    dumpers = [p for p in py_pids if _catches(p, signal.SIGUSR1)]
    if not dumpers:
        raise SupervisorError(
            f"the job's Python process(es) {', '.join(map(str, py_pids))} do not handle SIGUSR1 "
            "(not our engine) and py-spy is not installed on the host: pip install py-spy, then retry"
        )
    log = rd / records.OUTPUT_LOG
    texts = []
    for pid in dumpers:
        start = log.stat().st_size if log.exists() else 0
        os.kill(pid, signal.SIGUSR1)
        text = _read_appended(log, start, timeout_s)
        texts.append(f"--- pid {pid} ({procs.cmdline_of(pid)[:100]}) ---\n{text}")
    return {
        "method": f"faulthandler via SIGUSR1 to pid {', '.join(map(str, dumpers))}, read back from output.log "
        "(not our engine: log lines may be mixed in; install py-spy for a clean dump)",
        "text": "\n".join(texts),
    }


def _read_appended(path: Path, start: int, timeout_s: float, quiet_s: float = 0.3) -> str:
    """What was appended to path after `start`, once it has stopped growing for quiet_s."""
    deadline = time.monotonic() + timeout_s
    last_size = start
    last_change = time.monotonic()
    while time.monotonic() < deadline:
        try:
            size = path.stat().st_size
        except OSError:
            size = start
        now = time.monotonic()
        if size != last_size:
            last_size, last_change = size, now
        elif size > start and now - last_change >= quiet_s:
            break
        time.sleep(POLL_S)
    if last_size <= start:
        raise SupervisorError(f"no stack dump appeared in {path} within {timeout_s:g} s")
    with open(path, "rb") as fh:
        fh.seek(start)
        return fh.read(last_size - start).decode("utf-8", "replace")
