"""The ``stacks`` verb: every thread's stack of a live run (our engine's named dump, py-spy, or faulthandler)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from engine import stackdump
from engine.host import procs
from engine.supervisor import records, stack_hook
from engine.supervisor.common import SupervisorError, tree_of
from engine.supervisor.members import rank_pids, run_members
from engine.supervisor.records import LaunchRecord


def _is_python(pid: int) -> bool:
    exe = procs.exe_name(pid)
    return exe.startswith("python") or exe.startswith("pypy")


# How long the named (Python-level) dump may take before faulthandler's unnamed one is asked for. Python runs
# signal handlers in the main thread only, so a slow answer can also mean a loaded machine or a main thread in
# a C call while other threads run Python, where faulthandler's walk is unsafe: wait long enough that only a
# thread holding the GIL explains the silence (the named dump answers in 28 ms median, 63 ms max on 2 cores).
NAMED_DUMP_WAIT_S = 3.0
RAW_DUMP_WAIT_S = 0.5  # faulthandler writes inside its handler: its dump is whole once the file stops growing
DUMP_POLL_S = 0.01


def _read_raw_dump(path: Path, start: int) -> str:
    """What faulthandler appended to ``path`` after ``start``, once it has stopped growing (bounded)."""
    deadline = time.monotonic() + RAW_DUMP_WAIT_S
    size = start
    while time.monotonic() < deadline:
        time.sleep(DUMP_POLL_S)
        try:
            now = path.stat().st_size
        except OSError:
            return ""
        if now > start and now == size:
            break
        size = now
    try:
        with open(path, "rb") as fh:
            fh.seek(start)
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


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
    # No Python code ran for NAMED_DUMP_WAIT_S: a thread holds the GIL, so the walk reads frames that hold still.
    raw = ""
    if procs.catches_signal(pid, stackdump.FALLBACK_SIGNAL):
        os.kill(pid, stackdump.FALLBACK_SIGNAL)
        raw = _read_raw_dump(files.raw, raw_start)
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

    Our engine (it registered engine.stackdump), and a job's process under the stack hook (stack_hook.py) when
    py-spy is not installed: SIGUSR1, named threads from its own dump file in well under a second. Any other
    Python job: py-spy when installed; else why not. A process that handles SIGUSR1 itself is never signalled:
    its handler is the job's (a save on pre-emption, say), not a dump.
    """
    rd = Path(run_dir)
    cache = scanners if scanners is not None else records.ScannerCache()
    info = records.read_run(rd, boot_id or procs.read_boot_id(), cache)
    if info.state != "running":
        raise SupervisorError(f"run {rd.name} is not running ({info.state}): no stacks to dump")
    launch_rec = records.read_launch(rd) or LaunchRecord()
    job_pid = launch_rec.job_pid
    pids = tree_of(job_pid) if isinstance(job_pid, int) else []
    if not pids:
        raise SupervisorError(f"run {rd.name}: the job process is gone")
    # torchrun's ranks: in the job's tree while their agent lives, and named with their pid by their events.
    pids = sorted(set(pids) | set(run_members(rd, launch_rec, cache)))
    rank_of = {pid: rank for rank, pid in rank_pids(rd, launch_rec, cache).items()}
    py_pids = [p for p in pids if _is_python(p)]
    pyspy = shutil.which("py-spy")
    # Our engine, and a job's process under the stack hook while it still leaves SIGUSR1 to the hook (it drops its
    # markers when it takes the signal itself); a hooked job is read with py-spy where that is installed.
    engines = [
        p
        for p in py_pids
        if stackdump.dump_files(rd, p).raw.exists()
        and procs.catches_signal(p, stackdump.SIGNAL)
        and (pyspy is None or not stack_hook.hook_marker(rd, p).exists())
    ]
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
    if pyspy is not None:
        texts = []
        for pid in py_pids:
            res = subprocess.run(
                [pyspy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s + 10, check=False
            )
            texts.append(f"--- pid {pid} (py-spy dump, exit {res.returncode}) ---\n{res.stdout}{res.stderr}")
        return {"method": "py-spy dump", "text": "\n".join(texts)}
    takers = [p for p in py_pids if procs.catches_signal(p, signal.SIGUSR1)]
    if takers:  # its own handler (a save on pre-emption, say): signalling it could do anything but dump
        raise SupervisorError(
            f"the job's Python process(es) {', '.join(map(str, takers))} handle SIGUSR1 themselves (not through "
            "our stack hook), so they are not signalled; py-spy is not installed on the host: pip install py-spy, "
            "then retry"
        )
    raise SupervisorError(
        f"the job's Python process(es) {', '.join(map(str, py_pids))} do not handle SIGUSR1 "
        "(not our engine) and py-spy is not installed on the host: pip install py-spy, then retry"
    )
