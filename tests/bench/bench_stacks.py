"""Benchmark (on demand, not a test): stack dumps never harm the run they diagnose.

    python3 tests/bench/bench_stacks.py [-n 200] [--preset cpu-demo] [--set KEY=VALUE ...] [--max-s 1.0]

Starts the engine under the supervisor through a real agent (``python3 -m engine.trainer --preset cpu-demo``,
no step delay, so its threads are busy), waits for its first step, then asks the agent for ``stacks`` N
times back to back. Prints per dump whether the named dump answered, the latency figures, and whether the
engine was still running after every dump (a dump that kills it is a crash). Exit status 0 only with no crash,
every dump named and every dump within --max-s. tests/device/run calls it on a GPU with the H200 layout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from support.agent import AgentClient, end_runs, launch_and_wait  # noqa: E402

FIRST_STEP_WITHIN_S = 300.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=200, help="dumps to take (default 200)")
    ap.add_argument("--preset", default="cpu-demo")
    ap.add_argument("--set", action="append", default=[], help="engine config override, as for --set")
    ap.add_argument("--max-s", type=float, default=1.0, help="the slowest a named dump may answer")
    ap.add_argument("--label", default="cpu", help="the name printed with the result line")
    args = ap.parse_args(argv)
    overrides = ["step_delay_s=0.0", "log_every=10", "resume=false", *args.set]
    with tempfile.TemporaryDirectory(prefix="bench-stacks-") as tmp:
        root = Path(tmp)
        agent = AgentClient(root / "runs")
        try:
            command = [sys.executable, "-m", "engine.trainer", "--preset", args.preset]
            command += ["--output-dir", str(root / "out")]
            for item in overrides:
                command += ["--set", item]
            launched, _, up_s = launch_and_wait(agent, command, "first-step", FIRST_STEP_WITHIN_S, cwd=str(REPO))
            run_id = launched["run_id"]
            print(f"engine up: first step after {up_s:.1f} s (run {run_id})", flush=True)
            return _dumps(agent, run_id, args)
        finally:
            agent.close()
            end_runs(root / "runs")


def _running(agent: AgentClient, run_id: str) -> bool:
    run = agent.ok("run_info", run_id=run_id)["run"]
    return bool(run.get("state") == "running")


def _dumps(agent: AgentClient, run_id: str, args: argparse.Namespace) -> int:
    latencies: list[float] = []
    named = 0
    methods: dict[str, int] = {}
    crashes = 0
    for i in range(args.n):
        t0 = time.monotonic()
        reply = agent.request("stacks", timeout_s=20)
        elapsed_s = time.monotonic() - t0
        latencies.append(elapsed_s)
        if reply.get("ok", True) and isinstance(reply.get("result"), dict):
            method = str(reply["result"].get("method", ""))
        else:
            method = f"error: {reply.get('error') or reply.get('message') or reply}"
        methods[method] = methods.get(method, 0) + 1
        named += "named threads" in method
        if not _running(agent, run_id):
            crashes += 1
            print(f"dump {i + 1}: the engine is no longer running after it ({method})", flush=True)
            break
    n = len(latencies)
    slow = sum(1 for s in latencies if s > args.max_s)
    lat = sorted(latencies)
    p50, p99, worst = statistics.median(lat), lat[min(n - 1, int(0.99 * n))], lat[-1]
    for method, count in sorted(methods.items(), key=lambda kv: -kv[1]):
        print(f"  {count:4d} x {method[:160]}")
    print(
        f"stacks bench ({args.label}): {n} dumps, {crashes} crashes, {named} named, "
        f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, max {worst * 1000:.0f} ms, {slow} over {args.max_s:g} s"
    )
    ok = crashes == 0 and named == n == args.n and slow == 0
    print(f"{'PASS' if ok else 'FAIL'} stacks: {n} dumps, {crashes} crashes, max {worst:.2f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
