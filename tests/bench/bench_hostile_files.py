"""Benchmark (on demand, not a test): status and a subscribed agent on a run whose events.jsonl is huge.

    python3 tests/bench/bench_hostile_files.py [--size-mib 1024] [--subscribe-s 15] [-n 3] [--code DIR]

Builds a running run (its job a live sleep) in a temp dir under /tmp and prints, for it:
  * `python3 -m tui status local --json` before it has events: the cost of two fresh interpreters, for reference;
  * `python3 -m tui status local --json` on a run whose events.jsonl holds SIZE of valid event lines: wall time (the
    median and the slowest of -n fresh processes), the peak RSS (VmHWM) of the status process and of the agent it
    starts (the highest of the -n), and what the run said (last step, unread);
  * an agent (`python3 -m engine.agent.main`) subscribed to that run: its peak RSS after --subscribe-s seconds,
    when its first engine event and the run's last step reached the client, how many events and bytes it sent;
  * status again on a run whose events.jsonl is SIZE of one line with no newline.
--code DIR runs the CLI and the agent from another checkout (e.g. a `git worktree add` of an older commit) to
measure the figures before a change. With less than 3 GiB free under /tmp the file is 512 MiB, and it says so.
Goals: status <= 2 s and <= 200 MB RSS, a subscribed agent <= 200 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from support import hostile  # noqa: E402

from engine import protocol  # noqa: E402

MiB = 1 << 20


def _env(code: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(code))


@dataclass
class StatusFigures:
    rc: int
    wall_s: float
    status_mib: float | None  # peak RSS (VmHWM) of the status process
    agent_mib: float | None  # and of the agent it started
    last_step: object = None  # what the run said
    unread: object = None
    max_s: float = 0.0  # the slowest of several


def _statuses(code: Path, run_root: Path, n: int) -> StatusFigures:
    """``_status`` n times: the median and slowest wall time, the highest peaks, the last answer."""
    runs = [_status(code, run_root) for _ in range(max(1, n))]
    walls = sorted(r.wall_s for r in runs)

    def peak(found: list[float | None]) -> float | None:
        known = [f for f in found if f is not None]
        return max(known) if known else None

    last = runs[-1]
    return StatusFigures(
        last.rc,
        statistics.median(walls),
        peak([r.status_mib for r in runs]),
        peak([r.agent_mib for r in runs]),
        last.last_step,
        last.unread,
        walls[-1],
    )


def _status(code: Path, run_root: Path) -> StatusFigures:
    argv = [sys.executable, "-m", "tui", "status", "local", "--json", "--simulate-gpus", "2"]
    t0 = time.perf_counter()
    proc = subprocess.Popen([*argv, "--run-root", str(run_root)], stdout=subprocess.PIPE, env=_env(code), cwd=code)
    watch = hostile.PeakWatch(proc.pid).start()
    out, _ = proc.communicate(timeout=600)
    wall_s = time.perf_counter() - t0
    watch.stop()
    run = (json.loads(out).get("run") or {}) if proc.returncode == 0 else {}
    return StatusFigures(
        proc.returncode,
        wall_s,
        watch.peak_of("-m tui"),
        watch.peak_of("engine.agent"),
        run.get("last_step"),
        run.get("events_unread_bytes"),
        wall_s,
    )


def _subscribed(
    code: Path, run_root: Path, last_step: int, seconds: float
) -> tuple[float | None, dict[str, int], dict[str, float]]:
    """(the agent's peak RSS after ``seconds`` subscribed, counts of what it sent, when the first engine event and
    the last step came)."""
    argv = [sys.executable, "-m", "engine.agent.main", "--run-root", str(run_root), "--simulate-gpus", "2"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env(code), cwd=code)
    assert proc.stdin is not None and proc.stdout is not None
    counts = {"events": 0, "engine": 0, "bytes": 0, "warnings": 0}
    seen: dict[str, float] = {}
    t0 = time.monotonic()

    def read(stdout: IO[bytes]) -> None:
        for line in stdout:
            counts["events"] += 1
            counts["bytes"] += len(line)
            ev = json.loads(line)
            if ev.get("ev") == "engine":
                counts["engine"] += 1
                seen.setdefault("first_engine_s", time.monotonic() - t0)
                if ev["event"].get("kind") == "step" and ev["event"].get("step") == last_step:
                    seen.setdefault("last_step_s", time.monotonic() - t0)
            elif ev.get("ev") == "warning":
                counts["warnings"] += 1

    reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
    reader.start()
    proc.stdin.write(protocol.encode(protocol.command(1, "subscribe")))
    proc.stdin.flush()
    time.sleep(seconds)  # the figure is the agent's peak after this long, not an event to wait for
    peak = hostile.vm_hwm_mib(proc.pid)
    proc.stdin.close()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    reader.join(5)
    return peak, counts, seen


def _fmt(value: object, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}{unit}"
    return f"{value}{unit}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=1024, help="size of the events.jsonl (MiB)")
    ap.add_argument("--subscribe-s", type=float, default=15.0, help="how long the subscribed agent streams")
    ap.add_argument("-n", type=int, default=3, help="status processes per figure")
    ap.add_argument("--code", type=Path, default=REPO, help="checkout the CLI and the agent run from")
    ns = ap.parse_args()
    size = ns.size_mib * MiB
    free = hostile.free_bytes(Path("/tmp"))
    note = ""
    if free < 3 * 1024 * MiB and size > 512 * MiB:
        size, note = 512 * MiB, f" (only {free / 2**30:.1f} GiB free under /tmp: 512 MiB instead)"
    code = ns.code.resolve()
    rev = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    at = rev.stdout.strip() or "?"
    print(f"code: {code} at {at}; events.jsonl: {size / MiB:.0f} MiB{note}; cpus {os.cpu_count()}")
    with tempfile.TemporaryDirectory(prefix="bench-hostile-", dir="/tmp") as tmp:
        root = Path(tmp) / "root"
        run = hostile.running_run(root)
        try:
            st = _statuses(code, root, ns.n)  # what two fresh interpreters cost, whatever the files
            print(
                f"  status --json, no events yet: {_fmt(st.wall_s, ' s')} wall (median of {ns.n}, slowest "
                f"{_fmt(st.max_s, ' s')}); peak RSS status {_fmt(st.status_mib, ' MiB')}, agent "
                f"{_fmt(st.agent_mib, ' MiB')}; rc {st.rc}"
            )
            t0 = time.perf_counter()
            last_step = hostile.write_event_lines(run.events, size)
            wrote_mib = run.events.stat().st_size / MiB
            print(f"  wrote {wrote_mib:.0f} MiB of event lines in {time.perf_counter() - t0:.1f} s")
            st = _statuses(code, root, ns.n)
            print(
                f"  status --json, valid lines:   {_fmt(st.wall_s, ' s')} wall (median of {ns.n}, slowest "
                f"{_fmt(st.max_s, ' s')}); peak RSS status "
                f"{_fmt(st.status_mib, ' MiB')}, agent {_fmt(st.agent_mib, ' MiB')}; rc {st.rc}; "
                f"last_step {st.last_step} (written: {last_step}); events_unread_bytes {st.unread}"
            )
            peak, counts, seen = _subscribed(code, root, last_step, ns.subscribe_s)
            print(
                f"  subscribed agent, {ns.subscribe_s:.0f} s:       peak RSS {_fmt(peak, ' MiB')}; "
                f"first engine event {_fmt(seen.get('first_engine_s'), ' s')}, last step "
                f"{_fmt(seen.get('last_step_s'), ' s')}; sent {counts['events']} events "
                f"({counts['engine']} engine, {counts['warnings']} warnings), {counts['bytes'] / MiB:.1f} MiB"
            )
            run.events.unlink()
            hostile.write_line_without_end(run.events, size)
            st = _statuses(code, root, ns.n)
            print(
                f"  status --json, no newline:    {_fmt(st.wall_s, ' s')} wall (median of {ns.n}, slowest "
                f"{_fmt(st.max_s, ' s')}); peak RSS status "
                f"{_fmt(st.status_mib, ' MiB')}, agent {_fmt(st.agent_mib, ' MiB')}; rc {st.rc}; "
                f"events_unread_bytes {st.unread}"
            )
        finally:
            run.close()
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
