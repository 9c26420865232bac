"""Benchmark (on demand, not a test): how long one look at a host takes, ours against the seed's way.

    python3 tests/bench/bench_status.py [-n 15] [--gpus 8]

Starts its own sshd on 127.0.0.1 (the integration fixture's code) and prints, median and p90 of N:
  * `specdec-tui status local --json`, a fresh CLI process each time;
  * `specdec-tui status USER@127.0.0.1 --json` over loopback SSH, a fresh process and connection each time;
  * `status` over a live session (what the dashboard pays per refresh), local and SSH;
  * the seed's way: a fresh `ssh -i KEY -p PORT USER@127.0.0.1 'nvidia-smi --query-gpu=... || cat /proc/loadavg'`
    process per poll, one new connection each time.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tui.link.session import ConnectOptions, open_session  # noqa: E402

SEED_POLL = (
    "nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total --format=csv,noheader "
    "2>/dev/null || cat /proc/loadavg"
)


def _load_fixture_module() -> object:
    spec = importlib.util.spec_from_file_location("sshd_fixture", REPO / "tests" / "integration" / "conftest.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _times(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _run(argv: list[str], env: dict[str, str]) -> None:
    done = subprocess.run(argv, capture_output=True, env=env, timeout=120, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{argv[:4]}... failed ({done.returncode}): {done.stderr.decode(errors='replace')[-800:]}")


async def _session_times(target: str, opts: ConnectOptions, n: int) -> tuple[float, list[float]]:
    session = open_session(target, opts)
    t0 = time.perf_counter()
    await session.connect()
    connect_s = time.perf_counter() - t0
    try:
        await session.request("status", timeout_s=60)  # warm the agent's samplers
        times = []
        for _ in range(n):
            t1 = time.perf_counter()
            await session.request("status", timeout_s=60)
            times.append(time.perf_counter() - t1)
    finally:
        await session.close()
    return connect_s, times


def _row(name: str, times: list[float]) -> str:
    q = statistics.quantiles(times, n=10)[-1] if len(times) >= 2 else times[0]
    return f"  {name:<62} median {statistics.median(times) * 1000:8.1f} ms   p90 {q * 1000:8.1f} ms"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=15, help="samples per figure")
    ap.add_argument("--gpus", type=int, default=8, help="simulated GPUs the agent reports")
    ns = ap.parse_args()
    fixture = _load_fixture_module()
    with tempfile.TemporaryDirectory(prefix="bench-status-") as tmp:
        tmpd = Path(tmp)
        os.environ["SPECDEC_TMUX_SOCKET"] = f"bench-status-{os.getpid()}"
        with fixture.running_sshd(tmpd, os.environ["SPECDEC_TMUX_SOCKET"]) as sshd:  # type: ignore[attr-defined]
            run_root = tmpd / "run-root"
            run_root.mkdir()
            env = dict(os.environ, PYTHONPATH=str(REPO))
            cli = [sys.executable, "-m", "tui", "status"]
            common = ["--json", "--simulate-gpus", str(ns.gpus), "--run-root", str(run_root)]
            local_cmd = [*cli, "local", *common]
            ssh_cmd = [*cli, sshd.target, *sshd.args(), *common]
            seed_cmd = [
                "ssh", "-i", str(sshd.identity), "-p", str(sshd.port),
                "-o", f"UserKnownHostsFile={sshd.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "BatchMode=yes", "-F", "/dev/null", sshd.target, SEED_POLL,
            ]  # fmt: skip
            _run(ssh_cmd, env)  # first connect ships the bundle; not counted
            _run(local_cmd, env)
            _run(seed_cmd, env)
            cases = [
                ("specdec-tui status local --json (fresh process)", local_cmd),
                ("specdec-tui status over loopback SSH --json (fresh process)", ssh_cmd),
                ("seed: fresh `ssh ... nvidia-smi || cat /proc/loadavg` per poll", seed_cmd),
            ]
            rows = [_row(name, _times(functools.partial(_run, argv, env), ns.n)) for name, argv in cases]
            base = ConnectOptions(run_root=str(run_root), simulate_gpus=ns.gpus)
            ssh_opts = ConnectOptions(
                identity=str(sshd.identity),
                port=sshd.port,
                known_hosts=str(sshd.known_hosts),
                python=sys.executable,
                run_root=str(run_root),
                simulate_gpus=ns.gpus,
            )
            local_connect, local_live = asyncio.run(_session_times("local", base, ns.n))
            ssh_connect, ssh_live = asyncio.run(_session_times(sshd.target, ssh_opts, ns.n))
            rows += [
                _row("live session, local: one `status` request", local_live),
                _row("live session, SSH: one `status` request", ssh_live),
            ]
    print(f"status wall time, {ns.n} samples each, {ns.gpus} simulated GPUs, {os.cpu_count()} CPUs")
    print("\n".join(rows))
    print(f"  session connect (hello received): local {local_connect * 1000:.0f} ms, SSH {ssh_connect * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
