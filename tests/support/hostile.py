"""Hostile files for the bounds tests and the benchmark: a running run whose events.jsonl is huge (valid event lines,
or one line without end), and the peak memory of a process tree read from /proc (VmHWM).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from engine.host import procs
from engine.supervisor import records
from engine.supervisor.records import LaunchRecord

RUN_ID = "20260101-000000-huge"
HEAD = b'{"kind": "stage", "stage": "distributed", "pid": 4242, "local_rank": 0, "local_world_size": 1, "t": 1.0}\n'
# One training step as the engine writes it: a step event, then a heartbeat of each thread.
STEP = (
    b'{"kind": "step", "step": %d, "thread": "drafter0", "loss": [2.1, 2.3, 2.5], "acc": [0.61, 0.52, 0.44], '
    b'"loss_total": 5.12, "tok_s": 81234.5, "ms": {"fetch": 1.2, "fwd": 20.1, "bwd": 40.2, "opt": 3.3}, "t": %d.5}\n'
)
BEAT = b'{"kind": "heartbeat", "thread": "%s", "state": "training", "step": %d, "tok_s": 81234.5, "t": %d.5}\n'
THREADS = (b"producer", b"drafter0", b"drafter1", b"target")
STEPS_PER_WRITE = 2000


def write_event_lines(path: Path, size_bytes: int) -> int:
    """Fill ``path`` with about ``size_bytes`` of valid engine event lines (steps with their heartbeats, a stage
    first); the last step written."""
    step = 0
    with path.open("wb") as fh:
        fh.write(HEAD + b'{"kind": "stage", "stage": "training", "t": 2.0}\n')
        written = fh.tell()
        while written < size_bytes:
            t0 = 1_000_000_000 + step
            chunk = b"".join(
                STEP % (s, t0 + i) + b"".join(BEAT % (th, s, t0 + i) for th in THREADS)
                for i, s in enumerate(range(step, step + STEPS_PER_WRITE))
            )
            fh.write(chunk)
            written += len(chunk)
            step += STEPS_PER_WRITE
    return step - 1


def write_line_without_end(path: Path, size_bytes: int) -> None:
    """One line of ``size_bytes`` that never ends (written in blocks, not sparse: the reader really reads it)."""
    block = b"x" * (1 << 20)
    with path.open("wb") as fh:
        for _ in range(size_bytes // len(block)):
            fh.write(block)


@dataclass
class HugeRun:
    """A running run (its job a live ``sleep``) that ``<run_root>/current`` names."""

    run_root: Path
    run_dir: Path
    job: subprocess.Popen[bytes]

    @property
    def events(self) -> Path:
        return self.run_dir / records.EVENTS_JSONL

    def close(self) -> None:
        self.job.kill()
        self.job.wait()


def running_run(run_root: Path) -> HugeRun:
    """A run the agent reads as running: launch.json pins a live job, its output.log has one line."""
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    rd = records.run_dir_for(run_root, RUN_ID)
    rd.mkdir(parents=True)
    ticks = procs.start_ticks_of(job.pid)
    launch = LaunchRecord(
        run_id=RUN_ID,
        command=["python3", "train.py"],
        wrapper_pid=job.pid,
        wrapper_start_ticks=ticks,
        boot_id=procs.read_boot_id(),
        started_at=1.0,
        step_pattern=r"step=\d+",
        job_pid=job.pid,
        job_pgid=job.pid,
        job_start_ticks=ticks,
        job_started_at=1.0,
    )
    records.write_json_atomic(rd / records.LAUNCH_JSON, launch.to_json())
    (rd / records.OUTPUT_LOG).write_bytes(b"training\n")
    records.set_current(run_root, rd)
    return HugeRun(run_root, rd, job)


def vm_hwm_mib(pid: int) -> float | None:
    """The peak resident set of a live process (VmHWM), MiB; None once it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class PeakWatch:
    """Watches a process and its descendants until stopped: the highest VmHWM seen of each (pid -> MiB, cmdline)."""

    root: int
    interval_s: float = 0.01
    peaks: dict[int, float] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> PeakWatch:
        self._thread = threading.Thread(target=self._loop, name="peak-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                kids = [c.pid for c in psutil.Process(self.root).children(recursive=True)]
            except psutil.Error:
                kids = []
            for pid in [self.root, *kids]:
                hwm = vm_hwm_mib(pid)
                name = _cmdline(pid)  # read each time: a forked child has its parent's until it execs
                if hwm is not None:
                    self.peaks[pid] = max(hwm, self.peaks.get(pid, 0.0))
                    self.names[pid] = name or self.names.get(pid, "")
            self._stop.wait(self.interval_s)

    def peak_of(self, needle: str) -> float | None:
        """The peak of the watched processes whose command line contains ``needle``."""
        found = [mib for pid, mib in self.peaks.items() if needle in self.names.get(pid, "")]
        return max(found) if found else None


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
