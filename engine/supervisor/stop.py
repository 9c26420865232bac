"""The ``stop`` verb: SIGTERM to the run's processes (pinned by pid and start ticks), the grace, SIGKILL, then
wait (bounded) for its GPU devices to free.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.host import procs
from engine.host.holders import find_holders
from engine.supervisor import records
from engine.supervisor.common import KILL_WAIT_S, POLL_S, Progress, SupervisorError, noop, state_of, wait_until
from engine.supervisor.members import group_is_ours, kill_checked, parent_of, pgrp_of, run_members, signal_group_checked
from engine.supervisor.records import LaunchRecord


def stop(
    run_dir: Path | str,
    grace_s: float = 30.0,
    release_timeout_s: float = 30.0,
    progress: Progress = noop,
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

    launch_rec = _launch_record(rd)
    cache = scanners if scanners is not None else records.ScannerCache()
    info = records.read_run(rd, boot, cache)
    ours = records.run_pids(launch_rec)
    held_before = _holders_among(ours)
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
    # Before any SIGTERM: the wrapper then knows the job's end was asked for (its exit record says "stopped", not
    # torchrun's exit 1 as a failure) and restarts nothing.
    if _tell_wrapper(launch_rec, wrapper_pid, wrapper_ticks) and (launch_rec.spec or {}).get("restart") is not None:
        step("restart policy cancelled: nothing is restarted after this stop")

    def alive_members() -> list[int]:
        return _alive_members(members, pgid, launch_rec.job_start_ticks)

    def target_gone() -> bool:
        if members:
            return not alive_members()
        return not procs.process_alive(wrapper_pid, wrapper_ticks)

    if members:
        _term_members(members, pgid, step)
    else:
        if not procs.process_alive(wrapper_pid, wrapper_ticks):
            raise SupervisorError(f"run {rd.name}: neither its job nor its wrapper is alive: nothing to stop")
        if info.restart_state == "backoff":
            step(f"waiting to restart (backoff): SIGTERM to the wrapper (pid {wrapper_pid}) ends the run")
        else:
            step(f"job not started yet: SIGTERM to the wrapper (pid {wrapper_pid})")
        os.kill(wrapper_pid, signal.SIGTERM)
    escalated = _await_exit(target_gone, alive_members, members, pgid, grace_s, step)
    released = _await_release(ours, held_before, release_timeout_s, step)
    wait_until(lambda: (rd / records.EXIT_JSON).exists(), 3.0)
    exit_rec = records.read_exit(rd)
    if exit_rec is not None:
        step(f"exit record: {exit_rec.cause}")
    return {
        "stopped": not alive_members(),
        "escalated": escalated,
        "steps": steps,
        "run_id": rd.name,
        "job_pid": launch_rec.job_pid,
        "exit": exit_rec.to_json() if exit_rec is not None else None,
        "gpu_released": released,
    }


def _launch_record(rd: Path) -> LaunchRecord:
    """The run's launch record; a run submitted a moment ago gets two seconds to write it."""
    launch_rec = records.read_launch(rd)
    if launch_rec is None:
        deadline = time.monotonic() + 2.0  # a run submitted a moment ago: give the wrapper its first breath
        while launch_rec is None and time.monotonic() < deadline:
            time.sleep(POLL_S)
            launch_rec = records.read_launch(rd)
        if launch_rec is None:
            raise SupervisorError(f"run {rd.name} has no launch record (it never started): nothing to stop")
    return launch_rec


def _alive_members(members: dict[int, int], pgid: int | None, job_ticks: int | None) -> list[int]:
    """The run's processes still alive; processes started in the group since it was listed count only while the
    group is provably still the run's."""
    ours_now = isinstance(pgid, int) and group_is_ours(pgid, members)
    late = procs.group_members(pgid, None, job_ticks) if isinstance(pgid, int) and ours_now else []
    return sorted({pid for pid, ticks in members.items() if procs.process_alive(pid, ticks)} | set(late))


def _term_members(members: dict[int, int], pgid: int | None, step: Progress) -> None:
    """SIGTERM to the job's process group and to any rank outside it whose torchrun agent is gone."""
    in_group = [p for p in members if isinstance(pgid, int) and pgrp_of(p) == pgid]
    # A worker whose torchrun agent lives gets SIGTERM from it (one signal each: a second one while the first
    # is handled can deadlock a handler that logs); only an orphaned rank needs ours.
    outside = sorted(p for p in members if p not in in_group and parent_of(p) not in in_group)
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
        kill_checked(pid, members[pid], signal.SIGTERM)


def _await_exit(
    target_gone: Callable[[], bool],
    alive_members: Callable[[], list[int]],
    members: dict[int, int],
    pgid: int | None,
    grace_s: float,
    step: Progress,
) -> bool:
    """Waits the grace for the SIGTERMed processes to end, then SIGKILLs those left; returns whether it had to."""
    t0 = time.monotonic()
    if wait_until(target_gone, grace_s):
        step(f"exited {time.monotonic() - t0:.1f} s after SIGTERM")
        return False
    left = alive_members()
    step(f"still alive after the {grace_s:g} s grace ({len(left)} process(es)): SIGKILL to process group {pgid}")
    if isinstance(pgid, int) and left:
        signal_group_checked(pgid, members, signal.SIGKILL)
    for pid in left:
        if pid in members:
            kill_checked(pid, members[pid], signal.SIGKILL)
    if wait_until(target_gone, KILL_WAIT_S):
        step(f"killed: gone {time.monotonic() - t0:.1f} s after SIGTERM")
    else:
        stuck = alive_members()
        states = ", ".join(f"{p} ({state_of(p)})" for p in stuck[:8])
        step(f"still present {KILL_WAIT_S:g} s after SIGKILL: {states} (uninterruptible sleep in the driver?)")
    return True


def _await_release(ours: set[int], held_before: list[int], release_timeout_s: float, step: Progress) -> bool:
    """Waits (bounded) for the run's processes to let go of their GPU devices; returns whether they did."""
    t_rel = time.monotonic()
    released = wait_until(lambda: not _holders_among(ours), release_timeout_s)
    holders_left = _holders_among(ours)
    if released and not held_before:
        step("no GPU device was held by the run")
    elif released:
        step(f"GPU devices released ({time.monotonic() - t_rel:.1f} s after the processes ended)")
    else:
        step(f"GPU devices still held after {release_timeout_s:g} s by pid(s) {', '.join(map(str, holders_left))}")
    return released


def _tell_wrapper(launch_rec: LaunchRecord, wrapper_pid: int, wrapper_ticks: int | None) -> bool:
    """Tell the wrapper that a stop is coming (before its job is signalled): it restarts nothing more and records
    the end as stopped. False when it could not be told."""
    name = launch_rec.cancel_signal
    if name is None:
        return False  # a wrapper from before the stop signal: it would not know it
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


def _pids_text(pids: list[int]) -> str:
    return ", ".join(map(str, pids[:8])) + (f" and {len(pids) - 8} more" if len(pids) > 8 else "")


def _holders_among(pids: set[int]) -> list[int]:
    if not pids:
        return []
    return [h.pid for h in find_holders(run_pids=pids) if h.pid in pids and state_of(h.pid) != "zombie"]
