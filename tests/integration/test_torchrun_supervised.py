"""torchrun under the supervisor (real tmux on the test socket, real gloo ranks of the tiny engine on the CPU).

Pinned: first-step waits for every rank of the node; `stacks` dumps every rank, labelled; `stop` reaches every
rank although torchrun starts each in a session of its own; a rank that dies is named by `launch --wait` (exit 1,
the rank and its signal in `cause`, that rank's own last lines) and by `status`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import CliResult

from engine.supervisor import records

pytestmark = [pytest.mark.tmux, pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux")]

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 150.0

TINY_TOML = """
target = "tiny"
target_devices = ["cpu"]
drafter_devices = ["cpu", "cpu"]
drafter_mode = "replicas"
buckets = [64]
batch_size = 2
ttt_steps = 2
draft_vocab_size = 64
torch_threads = 1
tiny_hidden = 32
tiny_layers = 4
eval_holdout = 0
heartbeat_interval_s = 0.5
data = "random"
steps = 100000
step_delay_s = 0.05
stop_grace_s = 10
"""


def write_config(tmp: Path) -> Path:
    path = tmp / "engine.toml"
    path.write_text(TINY_TOML, encoding="utf-8")
    return path


def job_command(*torchrun_args: str) -> list[str]:
    """The job as `launch` gets it: this checkout's engine (PYTHONPATH; the editable install may point elsewhere)."""
    return ["env", f"PYTHONPATH={REPO}", "OMP_NUM_THREADS=1", sys.executable, "-m", "torch.distributed.run",
            "--max-restarts", "0", *torchrun_args]  # fmt: skip


def engine_args(config: Path, out: Path) -> list[str]:
    return ["-m", "engine.trainer", "--config", str(config), "--output-dir", str(out)]


def launch_cli(root: Path, command: list[str], *opts: str) -> list[str]:
    return [sys.executable, "-m", "tui", "launch", "local", "--run-root", str(root), "--cwd", str(REPO), *opts,
            "--", *command]  # fmt: skip


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def events(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def rank_pid(run_dir: Path, rank: int, timeout_s: float) -> int:
    """The pid rank ``rank`` reported in its ``distributed`` stage event (bounded wait on its events file)."""
    path = run_dir / ("events.jsonl" if rank == 0 else f"events.rank{rank}.jsonl")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = next((e["pid"] for e in events(path) if e.get("stage") == "distributed"), None)
        if pid is not None:
            return int(pid)
        time.sleep(0.1)
    raise AssertionError(f"rank {rank} reported no distributed stage in {path} within {timeout_s} s")


def current_run_dir(root: Path, timeout_s: float = 30.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rd = records.current_run_dir(root)
        if rd is not None:
            return rd
        time.sleep(0.05)
    raise AssertionError(f"no current run under {root}")


def alive(pid: int) -> bool:
    return records.process_alive(pid, None)


def test_first_step_covers_both_ranks_stacks_name_both_and_stop_leaves_no_rank(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    root = tmp_path / "root"
    cmd = job_command("--standalone", "--nproc-per-node", "2", *engine_args(write_config(tmp_path), tmp_path / "out"))
    r = cli(*launch_cli(root, cmd, "--wait", "first-step", "--json")[3:], timeout_s=START_TIMEOUT_S)
    rd = current_run_dir(root)
    try:
        assert r.returncode == 0, r.output + "\n".join(records.last_lines(rd / records.OUTPUT_LOG, 40))
        first_step = records.read_json(rd / records.MILESTONES_JSON)["first-step"]  # type: ignore[index]
        for name in ("events.jsonl", "events.rank1.jsonl"):
            steps = [e["t"] for e in events(rd / name) if e["kind"] == "step"]
            assert steps and min(steps) <= first_step + 1e-3, f"{name}: first-step before this rank stepped"
        pids = {rank: rank_pid(rd, rank, 5) for rank in (0, 1)}

        t0 = time.monotonic()
        st = cli("stacks", "local", "--run-root", str(root), timeout_s=60)
        stacks_s = time.monotonic() - t0
        assert st.returncode == 0, st.output
        for rank, pid in pids.items():
            assert f"--- rank {rank}, pid {pid} " in st.stdout, st.stdout[:2000]
        assert st.stdout.count("Thread drafter0 (") == 2 and st.stdout.count("Thread target0 (") == 2

        t0 = time.monotonic()
        stop = cli("stop", "local", "--run-root", str(root), "--grace", "20", timeout_s=90)
        stop_s = time.monotonic() - t0
        assert stop.returncode == 0, stop.output
        assert not [p for p in pids.values() if alive(p)], f"ranks alive after stop: {pids}\n{stop.output}"
        files = ("events.jsonl", "events.rank1.jsonl")
        ends = {n: [e for e in events(rd / n) if e["kind"] == "run_end"] for n in files}
        # Every rank agreed on the stop (SIGTERM reached both): a clean end on the same step, no SIGKILL needed.
        assert all(e and "SIGTERM" in e[-1]["reason"] for e in ends.values()), ends
        assert ends["events.jsonl"][-1]["step"] == ends["events.rank1.jsonl"][-1]["step"]
        assert "SIGKILL" not in stop.stdout, stop.stdout
    finally:
        cli("stop", "local", "--run-root", str(root), "--grace", "2", timeout_s=60)
    print(f"torchrun 2 ranks: first-step {r.elapsed_s:.1f} s, stacks {stacks_s:.2f} s, stop {stop_s:.1f} s")


def test_a_rank_killed_before_first_step_is_named_by_launch_wait_and_status(
    tmp_path: Path, cli: Callable[..., CliResult]
) -> None:
    root = tmp_path / "root"
    cmd = job_command("--standalone", "--nproc-per-node", "2", *engine_args(write_config(tmp_path), tmp_path / "out"))
    waiting = subprocess.Popen(
        launch_cli(root, cmd, "--wait", "first-step", "--json"),
        cwd=REPO, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        rd = current_run_dir(root)
        victim = rank_pid(rd, 1, START_TIMEOUT_S)
        os.kill(victim, signal.SIGKILL)
        t_kill = time.monotonic()
        out, err = waiting.communicate(timeout=90)
        named_s = time.monotonic() - t_kill
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
        cli("stop", "local", "--run-root", str(root), "--grace", "2", timeout_s=60)
    assert waiting.returncode == 1, out + err
    result = json.loads(out)
    assert result["cause"].startswith("rank 1 (node 0) killed by SIGKILL"), result["cause"]
    assert result["last_lines"] and all(ln.startswith("[rank 1] ") for ln in result["last_lines"]), result
    assert named_s < 30.0, f"the dead rank was named {named_s:.1f} s after the kill"
    status = cli("status", "local", "--run-root", str(root), "--json", timeout_s=60)
    run = json.loads(status.stdout)["run"]
    assert (run["failed_rank"], run["failed_node"]) == (1, 0) and "rank 1 (node 0) killed by SIGKILL" in run["cause"]
    print(f"rank 1 SIGKILLed: named by launch --wait {named_s:.1f} s later")
