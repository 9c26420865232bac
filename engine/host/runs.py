"""Which live processes belong to a supervised run, from what its launch record pinned (pid + start ticks).

A process counts only while it is provably the one recorded: the wrapper and the job are checked against
their recorded start ticks, and members of the job's process group must have started no earlier than the
job (a group id reused after the run ended names someone else's processes).
"""

from __future__ import annotations

from typing import Any

from engine.host import procs


def run_pids(launch_rec: dict[str, Any] | None, table: dict[int, procs.ProcStat] | None = None) -> set[int]:
    """The wrapper, the job, their descendants and the job's process group, as far as each is still ours."""
    if launch_rec is None:
        return set()
    stats = table if table is not None else procs.all_stats()
    out: set[int] = set()
    for key_pid, key_ticks in (("wrapper_pid", "wrapper_start_ticks"), ("job_pid", "job_start_ticks")):
        pid = launch_rec.get(key_pid)
        st = stats.get(pid) if isinstance(pid, int) else None
        if st is None or (launch_rec.get(key_ticks) is not None and st.start_ticks != launch_rec.get(key_ticks)):
            continue
        out.update(procs.tree_pids(st.pid, stats))
    pgid = launch_rec.get("job_pgid")
    if isinstance(pgid, int):
        out.update(procs.group_members(pgid, stats, launch_rec.get("job_start_ticks")))
    return out
