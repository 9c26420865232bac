"""Which live processes are a run's (its process group, torchrun's workers, the ranks its events name), each
pinned by pid and start ticks, and signalling them so that a reused pid or process group is never reached.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from engine import protocol
from engine.host import procs
from engine.supervisor import records
from engine.supervisor.records import LaunchRecord


def rank_pids(rd: Path, launch_rec: LaunchRecord, scanners: records.ScannerCache | None = None) -> dict[int, int]:
    """global rank -> pid of this node's torchrun ranks, from their ``distributed`` stage events."""
    scanner = scanners.scanner_for(rd, launch_rec) if scanners is not None else records.new_scanner(rd, launch_rec)
    ranks = scanner.poll().ranks
    return {r.rank: r.pid for r in ranks.values() if r.rank is not None and r.pid is not None}


def _runs_in(pid: int, rd: Path) -> bool:
    """The process was started for this run: its environment names this run directory (a reused pid's does not)."""
    env = procs.environ_of(pid)
    if env is None:
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


def parent_of(pid: int) -> int | None:
    st = procs.read_stat(pid)
    return st.ppid if st is not None else None


def pgrp_of(pid: int) -> int | None:
    st = procs.read_stat(pid)
    return st.pgrp if st is not None else None


def kill_checked(pid: int, start_ticks: int, sig: int) -> None:
    # Only the very process we listed (pid and start time): a pid reused since is left alone.
    if procs.process_alive(pid, start_ticks):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def killpg_quiet(pgid: int, sig: int) -> None:
    # The group may have emptied between our check and the signal: that is what we wanted.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def group_is_ours(pgid: int, pinned: dict[int, int]) -> bool:
    """A process we pinned (pid and start ticks) is still alive in the group: while it lives the group id cannot
    have been reused, so signalling the group reaches only the run's processes."""
    return any(procs.process_alive(pid, ticks) and pgrp_of(pid) == pgid for pid, ticks in pinned.items())


def signal_group_checked(pgid: int, pinned: dict[int, int], sig: int) -> bool:
    """``sig`` to the group when it is still ours, else to each pinned process still alive; True for the group."""
    if group_is_ours(pgid, pinned):
        killpg_quiet(pgid, sig)
        return True
    for pid, ticks in pinned.items():
        kill_checked(pid, ticks, sig)
    return False
