"""torchrun under the supervisor (real tmux on the test socket, real gloo ranks of the tiny engine on the CPU).

Pinned: first-step waits for every rank of the node; `stacks` dumps every rank, labelled; `stop` reaches every
rank although torchrun starts each in a session of its own, and the run then reads as stopped, not failed (torchrun
exits 1 on SIGTERM); a rank that dies is named by `launch --wait` (exit 1, the rank and its signal in `cause`, that
rank's own last lines) and by `status`; two loopback nodes stopped together read as stopped on each.
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
from support.agent import checkout_env
from support.waiting import wait_until
from torchrun_support import TINY_ENGINE_TOML, complete_events, wait_listening

from engine.host import procs
from engine.supervisor import records

pytestmark = [pytest.mark.tmux, pytest.mark.slow, pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux")]

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 150.0

TINY_TOML = (
    TINY_ENGINE_TOML
    + """data = "random"
steps = 100000
step_delay_s = 0.05
stop_grace_s = 10
"""
)


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


def rank_pid(run_dir: Path, rank: int, timeout_s: float) -> int:
    """The pid global rank ``rank`` reported in its ``distributed`` stage event, in whichever events file of the
    run directory it writes (a node's first rank writes events.jsonl), by a bounded wait."""

    def reported() -> int | None:
        for path in sorted(run_dir.glob("events*.jsonl")):
            for e in complete_events(path):
                if e.get("stage") == "distributed" and e.get("rank") == rank:
                    return int(e["pid"])
        return None

    return wait_until(reported, timeout_s, f"rank {rank}'s distributed stage in {run_dir}", interval_s=0.1)


def current_run_dir(root: Path, timeout_s: float = 30.0) -> Path:
    return wait_until(lambda: records.current_run_dir(root), timeout_s, f"a current run under {root}")


def alive(pid: int) -> bool:
    return procs.process_alive(pid, None)


def test_first_step_covers_both_ranks_stacks_name_both_and_stop_leaves_no_rank(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    root = tmp_path / "root"
    cmd = job_command("--standalone", "--nproc-per-node", "2", *engine_args(write_config(tmp_path), tmp_path / "out"))
    r = cli(*launch_cli(root, cmd, "--wait", "first-step", "--json")[3:], timeout_s=START_TIMEOUT_S)
    rd = current_run_dir(root)
    try:
        assert r.returncode == 0, r.output + "\n".join(records.last_lines(rd / records.OUTPUT_LOG, 40))
        first_step = records.read_json(rd / records.MILESTONES_JSON)["first-step"]  # type: ignore[index]
        for name in ("events.jsonl", "events.rank1.jsonl"):
            steps = [e["t"] for e in complete_events(rd / name) if e["kind"] == "step"]
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
        ends = {n: [e for e in complete_events(rd / n) if e["kind"] == "run_end"] for n in files}
        # Every rank agreed on the stop (SIGTERM reached both): a clean end on the same step, no SIGKILL needed.
        assert all(e and "SIGTERM" in e[-1]["reason"] for e in ends.values()), ends
        assert ends["events.jsonl"][-1]["step"] == ends["events.rank1.jsonl"][-1]["step"]
        assert "SIGKILL" not in stop.stdout, stop.stdout
        # torchrun itself exits 1 on SIGTERM (SignalException), yet nothing failed: the run reads as stopped.
        ended = wait_exit_record(rd, 10)
        assert ended["exit_code"] == 1 and ended["stopped"] is True and ended["stop_requested"] == "stop", ended
        assert ended["cause"] == "stopped (SIGTERM), torchrun exited with code 1; every rank ended cleanly", ended
        run = json.loads(cli("status", "local", "--run-root", str(root), "--json", timeout_s=60).stdout)["run"]
        assert (run["state"], run["cause"], run["failed_rank"]) == ("stopped", ended["cause"], None), run
        said = cli("status", "local", "--run-root", str(root), timeout_s=60)
        assert "stopped" in said.stdout and "fail" not in said.output.lower(), said.output
    finally:
        cli("stop", "local", "--run-root", str(root), "--grace", "2", timeout_s=60)
    print(f"torchrun 2 ranks: first-step {r.elapsed_s:.1f} s, stacks {stacks_s:.2f} s, stop {stop_s:.1f} s")


def test_a_rank_killed_before_first_step_is_named_by_launch_wait_and_status(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    root = tmp_path / "root"
    cmd = job_command("--standalone", "--nproc-per-node", "2", *engine_args(write_config(tmp_path), tmp_path / "out"))
    waiting = subprocess.Popen(
        launch_cli(root, cmd, "--wait", "first-step", "--json"),
        cwd=REPO, env=checkout_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_exit_record(run_dir: Path, timeout_s: float) -> dict[str, Any]:
    exit_json = run_dir / records.EXIT_JSON
    return wait_until(lambda: records.read_json(exit_json), timeout_s, f"{run_dir.name}'s exit record")


def launch_two_nodes(tmp_path: Path, roots: list[Path], waits: list[subprocess.Popen[str]]) -> list[Path]:
    """Two loopback nodes of one rank each, each under its own supervisor (run root), until both stepped: their run
    directories. ``waits`` gets each node's `launch --wait` as it starts, for the caller to clean up."""
    port = free_port()
    config = write_config(tmp_path)
    for n in (0, 1):
        cmd = job_command(
            "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            *engine_args(config, tmp_path / f"out{n}"),
        )  # fmt: skip
        waits.append(
            subprocess.Popen(
                launch_cli(roots[n], cmd, "--wait", "first-step", "--json"),
                cwd=REPO,
                env=checkout_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        if n == 0:  # node 0's agent hosts the rendezvous store, as the endpoint's machine does: the one kept
            wait_listening(port, START_TIMEOUT_S)
    for n, w in enumerate(waits):  # each node's supervisor saw its rank step, together with the other node
        out, err = w.communicate(timeout=START_TIMEOUT_S)
        assert w.returncode == 0, f"node {n}: {out}{err}"
    return [current_run_dir(r) for r in roots]


def test_two_loopback_nodes_train_under_the_supervisor_and_a_killed_node_stops_the_other_naming_it(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    roots = [tmp_path / f"node{n}-root" for n in (0, 1)]
    waits: list[subprocess.Popen[str]] = []
    try:
        dirs = launch_two_nodes(tmp_path, roots, waits)
        # c10d's rendezvous numbers the nodes in the order they join (not by --node-rank): ask the events.
        killed = next(e for e in complete_events(dirs[1] / "events.jsonl") if e.get("stage") == "distributed")
        survivor = next(e for e in complete_events(dirs[0] / "events.jsonl") if e.get("stage") == "distributed")
        node1_rank = int(killed["pid"])
        agent1 = records.read_json(dirs[1] / records.LAUNCH_JSON)["job_pgid"]  # type: ignore[index]
        t_kill = time.time()
        os.killpg(agent1, signal.SIGKILL)  # node 1's torchrun agent, as a machine's agent dies
        ended = wait_exit_record(dirs[0], 60)
        stop_s = float(ended["ended_at"]) - t_kill
        wait_until(lambda: not alive(node1_rank), 20, "node 1's rank to end with its killed agent")
        status0 = json.loads(cli("status", "local", "--run-root", str(roots[0]), "--json").stdout)["run"]
        status1 = json.loads(cli("status", "local", "--run-root", str(roots[1]), "--json").stdout)["run"]
    finally:
        for w in waits:
            if w.poll() is None:
                w.kill()
                w.wait()
        for r in roots:
            cli("stop", "local", "--run-root", str(r), "--grace", "2", timeout_s=60)
    dead = f"rank {killed['rank']} (node {killed['node']})"
    alive_ = f"rank {survivor['rank']} (node {survivor['node']})"
    assert status0["state"] == "failed", status0
    assert (status0["failed_rank"], status0["failed_node"]) == (killed["rank"], killed["node"]), status0
    assert status0["cause"].startswith(f"{dead} failed or left the run; {alive_} said: "), status0
    assert status1["state"] == "failed" and status1["signal"] == signal.SIGKILL, status1
    assert stop_s < 20.0, f"node 0 ended {stop_s:.1f} s after node 1's agent was killed"
    print(f"two loopback nodes: node 0 ended {stop_s:.2f} s after node 1's agent was SIGKILLed; {status0['cause']}")


def test_a_rank_that_raises_is_named_with_its_exception_and_its_own_last_lines(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    root = tmp_path / "root"
    fault = ["env", "SPECDEC_TEST_FAULT_RANK=1", "SPECDEC_TEST_FAULT_STEP=1"]
    engine = [str(REPO / "tests" / "integration" / "rank_fault.py"), "--config", str(write_config(tmp_path))]
    cmd = fault + job_command("--standalone", "--nproc-per-node", "2", *engine, "--output-dir", str(tmp_path / "out"))
    t0 = time.monotonic()
    r = cli(*launch_cli(root, cmd, "--wait", "first-step", "--json")[3:], timeout_s=START_TIMEOUT_S)
    took = time.monotonic() - t0
    try:
        assert r.returncode == 1, r.output
        result = json.loads(r.stdout)
        assert result["cause"].startswith("rank 1 (node 0): thread drafter"), result["cause"]
        assert "RuntimeError: injected fault on rank 1 at step 1" in result["cause"], result["cause"]
        assert result["last_lines"] and all(ln.startswith("[rank 1] ") for ln in result["last_lines"]), result
        # The wait ends on the rank's thread_error event, with its traceback, before the rank's log says more.
        assert result["detail"].rstrip().endswith("RuntimeError: injected fault on rank 1 at step 1"), result
    finally:
        cli("stop", "local", "--run-root", str(root), "--grace", "2", timeout_s=60)
    print(f"rank 1 raised: launch --wait answered in {took:.1f} s: {result['cause'][:160]}")


def test_a_stop_of_both_loopback_nodes_reads_stopped_on_each(tmp_path: Path, cli: Callable[..., Any]) -> None:
    roots = [tmp_path / f"node{n}-root" for n in (0, 1)]
    waits: list[subprocess.Popen[str]] = []
    try:
        dirs = launch_two_nodes(tmp_path, roots, waits)
        stops = [
            subprocess.Popen(
                [sys.executable, "-m", "tui", "stop", "local", "--run-root", str(r), "--grace", "20"],
                cwd=REPO,
                env=checkout_env(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in roots
        ]
        said = [s.communicate(timeout=90)[0] for s in stops]
        assert [s.returncode for s in stops] == [0, 0], said
        ended = [wait_exit_record(d, 10) for d in dirs]
        runs = [json.loads(cli("status", "local", "--run-root", str(r), "--json").stdout)["run"] for r in roots]
    finally:
        for w in waits:
            if w.poll() is None:
                w.kill()
                w.wait()
        for r in roots:
            cli("stop", "local", "--run-root", str(r), "--grace", "2", timeout_s=60)
    for n, (run, rec) in enumerate(zip(runs, ended, strict=True)):
        assert run["state"] == "stopped" and run["failed_rank"] is None, f"node {n}: {run}\n{said[n]}"
        assert rec["cause"].startswith("stopped (SIGTERM), torchrun "), rec
    print(f"two loopback nodes stopped: {ended[0]['cause']} | {ended[1]['cause']}")


def test_a_rank_that_raises_on_its_way_out_of_a_stop_fails_the_run_named(
    tmp_path: Path, cli: Callable[..., Any]
) -> None:
    root = tmp_path / "root"
    fault = ["env", "SPECDEC_TEST_FAULT_RANK=1", "SPECDEC_TEST_FAULT_ON_STOP=1"]
    engine = [str(REPO / "tests" / "integration" / "rank_fault.py"), "--config", str(write_config(tmp_path))]
    cmd = fault + job_command("--standalone", "--nproc-per-node", "2", *engine, "--output-dir", str(tmp_path / "out"))
    r = cli(*launch_cli(root, cmd, "--wait", "first-step", "--json")[3:], timeout_s=START_TIMEOUT_S)
    try:
        assert r.returncode == 0, r.output
        stop = cli("stop", "local", "--run-root", str(root), "--grace", "20", timeout_s=90)
        assert stop.returncode == 0, stop.output
        ended = wait_exit_record(current_run_dir(root), 10)
        run = json.loads(cli("status", "local", "--run-root", str(root), "--json").stdout)["run"]
    finally:
        cli("stop", "local", "--run-root", str(root), "--grace", "2", timeout_s=60)
    # The stop was asked for, but rank 1 crashed on its own: its exception is the cause, not the stop.
    assert ended["stop_requested"] == "stop" and "stopped" not in ended, ended
    assert run["state"] == "failed" and (run["failed_rank"], run["failed_node"]) == (1, 0), run
    assert run["cause"].startswith("rank 1 (node 0): thread "), run["cause"]
    assert "RuntimeError: injected fault on rank 1 while stopping" in run["cause"], run["cause"]
