"""Agent cost figures (run on demand: python3 tests/bench/bench_agent.py [--seconds 10]).

Prints:
* agent CPU seconds per wall second while streaming 8 simulated GPUs at 10 Hz plus the process scan
  (utime+stime of the agent from /proc/<pid>/stat over the window), with and without a live run;
* the /proc/*/fd scan for /dev/nvidia* holders and the full find_holders, per call;
* the wall time of one `status` round trip to a warm agent.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.agent import AgentClient, Event  # noqa: E402

from engine.host import holders, procs  # noqa: E402
from engine.supervisor import records  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    st = procs.read_stat(pid)
    assert st is not None, "agent died"
    return st.cpu_ticks / CLK_TCK


class EventCounts:
    """Events of each kind the agent sent, counted as they arrive."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = {}

    def __call__(self, ev: Event) -> None:
        self.by_kind[ev["ev"]] = self.by_kind.get(ev["ev"], 0) + 1


def round_trip_s(agent: AgentClient, cmd: str, **args: object) -> float:
    t0 = time.perf_counter()
    agent.request(cmd, reply_within_s=30, **args)
    return time.perf_counter() - t0


def measure_stream(run_root: Path, seconds: float, procs_interval_s: float) -> tuple[float, dict[str, int], int]:
    seen = EventCounts()
    a = AgentClient(run_root, simulate_gpus=8, on_event=seen)
    try:
        a.ok("ping")
        a.ok("subscribe", gpu_interval_s=0.1, procs_interval_s=procs_interval_s)
        time.sleep(1.0)  # let the first scans and imports settle before the window opens
        c0, t0, n0, b0 = cpu_s(a.proc.pid), time.monotonic(), dict(seen.by_kind), a.bytes_received
        time.sleep(seconds)
        c1, t1 = cpu_s(a.proc.pid), time.monotonic()
        counts = {k: v - n0.get(k, 0) for k, v in seen.by_kind.items()}
        return (c1 - c0) / (t1 - t0), counts, a.bytes_received - b0
    finally:
        a.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=10.0)
    ns = ap.parse_args()
    nproc = len(procs.list_pids())
    print(f"host: {os.cpu_count()} CPUs, {nproc} processes, python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runroot"
        root.mkdir()
        for label, interval in (("procs every 1.0 s", 1.0), ("procs every 0.1 s", 0.1)):
            ratio, counts, nbytes = measure_stream(root, ns.seconds, interval)
            print(
                f"stream, no run, 8 sim GPUs @10 Hz, {label}: {ratio * 1000:.1f} ms CPU per s "
                f"({ratio * 100:.2f}% of one core); events {counts}; {nbytes / ns.seconds / 1024:.1f} KiB/s"
            )
        # A live run: a python job with 8 threads and 4 children, its pid holding all 8 simulated GPUs.
        job = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import threading, subprocess, time\n"
                "e = threading.Event()\n"
                "[threading.Thread(target=e.wait, daemon=True).start() for _ in range(8)]\n"
                "kids = [subprocess.Popen(['sleep', '600']) for _ in range(4)]\n"
                "time.sleep(600)\n",
            ],
            start_new_session=True,
        )
        try:
            rd = records.run_dir_for(root, "bench-run")
            rd.mkdir(parents=True)
            st = procs.read_stat(job.pid)
            assert st is not None
            records.write_json_atomic(
                rd / records.LAUNCH_JSON,
                {
                    "run_id": "bench-run",
                    "command": ["python3"],
                    "job_pid": job.pid,
                    "job_start_ticks": st.start_ticks,
                    "job_pgid": job.pid,
                    "boot_id": procs.read_boot_id(),
                    "started_at": time.time(),
                },
            )
            (rd / records.OUTPUT_LOG).write_bytes(b"step=1\n" * 1000)
            records.set_current(root, rd)
            ratio, counts, nbytes = measure_stream(root, ns.seconds, 1.0)
            print(
                f"stream, live run (9 threads, 5 processes), 8 sim GPUs @10 Hz, procs every 1.0 s: "
                f"{ratio * 1000:.1f} ms CPU per s ({ratio * 100:.2f}% of one core); events {counts}"
            )
            a = AgentClient(root, simulate_gpus=8)
            try:
                a.ok("ping")
                times = [round_trip_s(a, "status") for _ in range(30)]
                print(
                    f"status round trip (warm local agent, live run): median {statistics.median(times) * 1000:.1f} ms,"
                    f" max {max(times) * 1000:.1f} ms"
                )
            finally:
                a.close()
        finally:
            job.kill()
            job.wait()
            for pid in procs.list_pids():  # the job's sleep children (same session): end them by recorded group
                s = procs.read_stat(pid)
                if s is not None and s.pgrp == job.pid and s.pid != os.getpid():
                    os.kill(pid, 9)

    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        procs.scan_device_holders("/dev")
    scan_ms = (time.perf_counter() - t0) / n * 1000
    t0 = time.perf_counter()
    for _ in range(n):
        holders.find_holders("/dev", holders.NvmlView(pid_used_mib={2**22 + 1: 100.0}))
    holders_ms = (time.perf_counter() - t0) / n * 1000
    t0 = time.perf_counter()
    for _ in range(n):
        procs.all_stats()
    stats_ms = (time.perf_counter() - t0) / n * 1000
    print(f"/proc/*/fd scan for /dev/nvidia* ({nproc} processes): {scan_ms:.2f} ms per scan")
    print(f"find_holders incl. one unresolved NVML pid: {holders_ms:.2f} ms; /proc/*/stat table: {stats_ms:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
