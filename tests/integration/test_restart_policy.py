"""The restart policy, end to end: the real agent launches under real tmux (private socket), the wrapper restarts.

Each job reads SPECDEC_ATTEMPT (1 for the first start) to decide how this attempt ends, so every scenario is
deterministic. Backoffs and stall times are fractions of a second; every wait is bounded and watches the
run's records. The restart timings (exit -> restarted -> first output) are printed (pytest -s shows them).
"""

from __future__ import annotations

import shutil
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from support.agent import REPO_ROOT, AgentClient
from support.procfs import pid_alive
from support.waiting import wait_until

from engine import protocol
from engine.host import procs
from engine.supervisor import records
from tui.restarts import line as restart_line

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]

END_WITHIN_S = 30.0
FAST = {"backoff_s": 0.2, "grace_s": 1.0}

FAILS_TWICE = textwrap.dedent(
    """
    import os, sys
    attempt = int(os.environ["SPECDEC_ATTEMPT"])
    print(f"attempt {attempt} starts", flush=True)
    sys.exit(1 if attempt < 3 else 0)
    """
)
ALWAYS_FAILS = 'import os, sys; print("attempt", os.environ["SPECDEC_ATTEMPT"], "fails", flush=True); sys.exit(7)'
# The first attempt makes one step, then hangs in a sleep; the engine's SIGUSR1 stack dump is registered.
STALLS_ONCE = textwrap.dedent(
    """
    import os, time
    from engine import stackdump
    stackdump.install(os.environ["SPECDEC_RUN_DIR"])
    attempt = int(os.environ["SPECDEC_ATTEMPT"])
    print(f"attempt {attempt} step=1", flush=True)
    if attempt == 1:
        time.sleep(600)  # the hang
    print(f"attempt {attempt} step=2 done", flush=True)
    """
)
# The same job as it is written elsewhere: nothing of ours imported, no handler registered.
FOREIGN_STALLS_ONCE = textwrap.dedent(
    """
    import os, threading, time
    threading.Thread(target=time.sleep, args=(600,), name="loader", daemon=True).start()
    attempt = int(os.environ["SPECDEC_ATTEMPT"])
    print(f"attempt {attempt} step=1", flush=True)
    if attempt == 1:
        time.sleep(600)  # the hang
    print(f"attempt {attempt} step=2 done", flush=True)
    """
)
OOM_ONCE = textwrap.dedent(
    """
    import os, sys
    attempt = int(os.environ["SPECDEC_ATTEMPT"])
    print(f"attempt {attempt} PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')}", flush=True)
    if attempt == 1:
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB", file=sys.stderr, flush=True)
        sys.exit(1)
    """
)


def launch(agent: AgentClient, code: str, deadlines_s: dict[str, float] | None = None, **policy: Any) -> Path:
    """Launch ``code`` as a script file (so a stack dump shows its source lines) under the restart policy."""
    script = Path(agent.hello["run_root"]) / f"job-{time.monotonic_ns()}.py"
    script.write_text(code)
    launched = agent.ok(
        "launch",
        command=[sys.executable, str(script)],
        cwd=str(REPO_ROOT),
        # A job's environment is the private tmux server's, from whichever test started it (over SSH: no
        # PYTHONPATH); the jobs that import the engine name this checkout themselves.
        env={"PYTHONPATH": str(REPO_ROOT)},
        restart={**FAST, **policy},
        deadlines_s=deadlines_s or {},
    )
    return Path(launched["run_dir"])


def ended(run_dir: Path, timeout_s: float = END_WITHIN_S) -> protocol.RunInfo:
    def done() -> protocol.RunInfo | None:
        info = records.read_run(run_dir, procs.read_boot_id())
        return info if info.state in ("exited", "failed", "stopped") else None

    info: protocol.RunInfo = wait_until(done, timeout_s, f"run {run_dir.name} to end")
    return info


def output(run_dir: Path) -> str:
    """The run's output.log so far ("" before the wrapper has created it)."""
    try:
        return (run_dir / records.OUTPUT_LOG).read_text(errors="replace")
    except FileNotFoundError:
        return ""


def report_timings(what: str, restarts: list[dict[str, Any]]) -> None:
    for r in restarts:
        to_start = r["restarted_at"] - r["at"]
        to_output = r["first_output_at"] - r["at"] if r.get("first_output_at") else float("nan")
        print(
            f"\n[timing] {what}: restart after attempt {r['attempt']} ({r['cause']}, backoff {r['backoff_s']:g} s): "
            f"exit -> restarted {to_start * 1000:.0f} ms, exit -> first output {to_output * 1000:.0f} ms"
        )


def test_a_job_that_fails_twice_then_succeeds_is_restarted_twice_and_ends_succeeded(agent: AgentClient) -> None:
    run_dir = launch(agent, FAILS_TWICE, on=["crash"], max=3)
    info = ended(run_dir)
    assert info.state == "exited" and info.exit_code == 0, info
    assert [(r["attempt"], r["cause"], r["exit_code"]) for r in info.restarts] == [(1, "crash", 1), (2, "crash", 1)]
    assert info.restart_max == 3 and info.restart_state == "done"
    # One run, one log: every attempt's words in order, each restart announced between them.
    log = output(run_dir)
    marks = [
        "attempt 1 starts",
        "restart 1/3 in 0.2 s",
        "attempt 2 of run",
        "attempt 2 starts",
        "restart 2/3 in 0.2 s",
        "attempt 3 of run",
        "attempt 3 starts",
    ]
    positions = [log.find(m) for m in marks]
    assert -1 not in positions and positions == sorted(positions), log
    # status --json carries the restarts, with their causes.
    run = agent.ok("status")["run"]
    assert run["run_id"] == run_dir.name and run["state"] == "exited"
    assert [r["cause"] for r in run["restarts"]] == ["crash", "crash"] and run["restart_max"] == 3
    for r in info.restarts:
        assert r["restarted_at"] - r["at"] >= 0.2  # the backoff was kept
        assert r["first_output_at"] >= r["restarted_at"]
    report_timings("crash", info.restarts)


def test_a_job_that_always_fails_stops_after_max_restarts_with_the_causes_listed(agent: AgentClient) -> None:
    run_dir = launch(agent, ALWAYS_FAILS, on=["crash", "oom"], max=2)
    info = ended(run_dir)
    assert info.state == "failed" and info.exit_code == 7
    assert [r["cause"] for r in info.restarts] == ["crash", "crash"]
    assert info.restart_state == "gave_up"
    exit_rec = records.read_json(run_dir / records.EXIT_JSON) or {}
    assert exit_rec["cause"] == (
        "gave up after 2 restarts (attempt 1: exited with code 7; attempt 2: exited with code 7): "
        "the last attempt (3) exited with code 7"
    )
    assert exit_rec["attempts"] == 3
    assert output(run_dir).count("fails") == 3


DIES_DIFFERENTLY = textwrap.dedent(
    """
    import os
    attempt = int(os.environ["SPECDEC_ATTEMPT"])
    print(f"attempt {attempt} starts", flush=True)
    raise [ValueError("first"), KeyError("second"), RuntimeError("third")][attempt - 1]
    """
)


def test_each_attempts_own_cause_is_kept_in_order_and_the_run_ends_with_the_last_ones(agent: AgentClient) -> None:
    run_dir = launch(agent, DIES_DIFFERENTLY, on=["crash"], max=2)
    info = ended(run_dir)
    assert info.state == "failed" and info.exit_code == 1 and info.restart_state == "gave_up"
    # The run's cause is the last attempt's root cause, though the appended log starts with the first one's.
    assert info.cause == "RuntimeError: third; exit code 1; no step reached", info.cause
    doc = records.read_json(run_dir / records.RESTARTS_JSON) or {}
    reasons = [(r["attempt"], r["reason"]) for r in doc["restarts"]]
    assert reasons == [(1, "ValueError: first"), (2, "KeyError: 'second'")]
    exit_rec = records.read_json(run_dir / records.EXIT_JSON) or {}
    assert exit_rec["root_cause"] == "RuntimeError: third"
    assert exit_rec["cause"] == (
        "gave up after 2 restarts (attempt 1: ValueError: first; attempt 2: KeyError: 'second'): "
        "the last attempt (3) RuntimeError: third; exited with code 1"
    )
    assert "crash, crash, crash" not in exit_rec["cause"]
    # status carries every attempt's own cause; the CLI and the dashboard print each restart with it.
    run = agent.ok("status")["run"]
    assert run["cause"] == info.cause
    assert [r["reason"] for r in run["restarts"]] == ["ValueError: first", "KeyError: 'second'"]
    said = [restart_line(i, r, run["restart_max"]) for i, r in enumerate(run["restarts"], start=1)]
    assert said[0].startswith("restart 1/2 at ") and said[0].endswith(": crash: ValueError: first; exited with code 1")
    assert said[1].endswith(": crash: KeyError: 'second'; exited with code 1"), said


def test_a_stalled_job_is_dumped_stopped_and_restarted(agent: AgentClient) -> None:
    # Starting Python may take longer than stall_s on a loaded box: the first-step deadline bounds the start.
    run_dir = launch(agent, STALLS_ONCE, deadlines_s={"first-step": 20.0}, on=["hang"], max=2, stall_s=1.0)
    t0 = time.monotonic()
    info = ended(run_dir)
    assert info.state == "exited" and info.exit_code == 0, output(run_dir)
    assert time.monotonic() - t0 < 15.0
    [hang] = info.restarts
    assert hang["cause"] == "hang" and hang["signal"] == signal.SIGTERM  # stopped gracefully: SIGTERM sufficed
    assert hang["stacks"] == "stacks/hang-attempt-1.txt"
    dump = (run_dir / hang["stacks"]).read_text()
    assert "named threads" in dump.splitlines()[0]
    assert "Thread MainThread" in dump and "time.sleep(600)  # the hang" in dump, dump
    log = output(run_dir)
    assert "attempt 1 hung: no step for" in log and "attempt 2 step=2 done" in log
    report_timings("hang", info.restarts)


@pytest.mark.skipif(shutil.which("py-spy") is not None, reason="the case is a host without py-spy")
def test_a_stalled_job_that_is_not_ours_gets_every_threads_stack_on_a_host_without_py_spy(agent: AgentClient) -> None:
    """The README promises every thread's stack before a hang restart; restarts.json said "no stack dump" for any
    job but our engine unless py-spy was installed."""
    run_dir = launch(agent, FOREIGN_STALLS_ONCE, deadlines_s={"first-step": 20.0}, on=["hang"], max=2, stall_s=1.0)
    info = ended(run_dir)
    assert info.state == "exited" and info.exit_code == 0, output(run_dir)
    [hang] = info.restarts
    assert hang["stacks"] == "stacks/hang-attempt-1.txt", hang
    dump = (run_dir / hang["stacks"]).read_text()
    assert "named threads" in dump.splitlines()[0], dump
    assert "Thread MainThread" in dump and "time.sleep(600)  # the hang" in dump, dump
    assert "Thread loader" in dump, dump


def test_an_oom_exit_restarts_with_expandable_segments_and_says_so(agent: AgentClient) -> None:
    run_dir = launch(agent, OOM_ONCE, on=["crash", "oom"], max=1)
    info = ended(run_dir)
    assert info.state == "exited" and info.exit_code == 0, output(run_dir)
    [oom] = info.restarts
    assert oom["cause"] == "oom" and "torch.OutOfMemoryError: CUDA out of memory" in oom["detail"]
    assert oom["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    log = output(run_dir)
    assert "attempt 1 PYTORCH_CUDA_ALLOC_CONF=None" in log
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True added to the job's environment" in log
    assert "attempt 2 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in log  # the job itself proves it
    report_timings("oom", info.restarts)


def test_stop_during_the_backoff_ends_the_run_promptly_and_restarts_nothing(agent: AgentClient) -> None:
    run_dir = launch(agent, ALWAYS_FAILS, on=["crash"], max=3, backoff_s=30.0)

    def in_backoff() -> bool:
        return records.read_run(run_dir, procs.read_boot_id()).restart_state == "backoff"

    wait_until(in_backoff, 20, "the first restart's backoff")
    t0 = time.monotonic()
    result = agent.ok("stop", grace_s=5, release_timeout_s=1)
    stop_s = time.monotonic() - t0
    assert stop_s < 3.0, f"stop took {stop_s:.2f} s"
    assert result["stopped"] is True
    assert any("waiting to restart (backoff)" in s for s in result["steps"]), result["steps"]
    info = records.read_run(run_dir, procs.read_boot_id())
    assert info.state == "failed" and info.restart_state == "cancelled"
    assert len(info.restarts) == 1
    assert "restart cancelled" in str(result["exit"]["cause"])
    launch_rec = records.read_json(run_dir / records.LAUNCH_JSON) or {}
    assert launch_rec["attempt"] == 1 and not pid_alive(launch_rec["wrapper_pid"])
    assert output(run_dir).count("fails") == 1


def test_stop_of_a_running_attempt_cancels_the_policy(agent: AgentClient) -> None:
    run_dir = launch(agent, "import time; print('up', flush=True); time.sleep(600)", on=["crash"], max=3)
    wait_until(lambda: "up" in output(run_dir), 20, "the job's first output")
    result = agent.ok("stop", grace_s=5, release_timeout_s=1)
    assert result["stopped"] is True
    assert "restart policy cancelled: nothing is restarted after this stop" in result["steps"]
    assert result["exit"]["signal"] == signal.SIGTERM
    info = records.read_run(run_dir, procs.read_boot_id())
    assert info.state == "stopped" and info.restarts == [] and info.restart_state == "cancelled"  # asked for
    launch_rec = records.read_json(run_dir / records.LAUNCH_JSON) or {}
    assert launch_rec["attempt"] == 1
    wait_until(lambda: not pid_alive(launch_rec["wrapper_pid"]), 5, "the wrapper to exit")


LEAVES_A_WORKER = textwrap.dedent(
    """
    import os, subprocess, sys
    attempt = int(os.environ["SPECDEC_ATTEMPT"])
    if attempt == 1:
        worker = subprocess.Popen(["sleep", "600"])  # in the job's process group, like a launcher's worker
        print(f"worker {worker.pid}", flush=True)
        os._exit(1)  # the launcher dies, its worker lives on (and would hold the GPU)
    print("attempt 2 runs alone", flush=True)
    """
)


def test_what_is_left_of_a_crashed_attempts_group_is_ended_before_the_restart(agent: AgentClient) -> None:
    run_dir = launch(agent, LEAVES_A_WORKER, on=["crash"], max=1)
    info = ended(run_dir)
    assert info.state == "exited" and info.exit_code == 0, output(run_dir)
    log = output(run_dir)
    worker_pid = int(log.split("worker ", 1)[1].split()[0])
    assert not pid_alive(worker_pid)
    ended_at = log.index("1 process(es) of the ended attempt's group remain: SIGTERM to group")
    assert ended_at < log.index("attempt 2 runs alone")


# The head of a job that reports a dead drafter thread as the engine does: a thread_error in its events file.
REPORTS_A_DEAD_THREAD = textwrap.dedent(
    """
    import json, os, sys, time
    def thread_dies():
        err = {"t": time.time(), "kind": "thread_error", "thread": "drafter0", "exc_type": "RuntimeError",
               "message": "boom", "traceback": "", "policy": "stop"}
        with open(os.environ["SPECDEC_EVENTS"], "a") as ev:
            ev.write(json.dumps(err) + "\\n")
    """
)
THREAD_DIES_ONCE = REPORTS_A_DEAD_THREAD + textwrap.dedent(
    """
    attempt = int(os.environ["SPECDEC_ATTEMPT"])
    if attempt == 1:
        thread_dies()
        time.sleep(0.3)  # the engine takes a moment to stop its other threads
        sys.exit(1)
    print("step=1", flush=True)
    """
)


def test_a_wait_goes_on_through_a_restart_after_a_dead_thread(agent: AgentClient) -> None:
    run_dir = launch(agent, THREAD_DIES_ONCE, on=["crash"], max=1)
    res = agent.ok("wait", run_id=run_dir.name, milestone="first-step", timeout_s=20)
    assert res["ok"] is True, res
    info = ended(run_dir)
    assert [r["cause"] for r in info.restarts] == ["crash"] and info.exit_code == 0


# Attempt 1: a thread dies, then the process waits for "go" and exits 1; attempt 2 lives until "done".
DEAD_THREAD_THEN_HEALTHY = REPORTS_A_DEAD_THREAD + textwrap.dedent(
    """
    here = os.path.dirname(os.path.abspath(__file__))
    def wait_for(name):
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(here, name)) and time.monotonic() < deadline:
            time.sleep(0.02)
    attempt = int(os.environ["SPECDEC_ATTEMPT"])
    if attempt == 1:
        thread_dies()
        wait_for("go")
        sys.exit(1)
    print("attempt 2 up", flush=True)
    wait_for("done")
    """
)


def test_the_first_attempts_dead_thread_is_not_reported_after_the_restart(agent: AgentClient) -> None:
    here = Path(agent.hello["run_root"])
    run_dir = launch(agent, DEAD_THREAD_THEN_HEALTHY, on=["crash"], max=1)

    def dead_threads() -> list[dict[str, Any]]:
        return [a for a in agent.ok("status")["anomalies"] if a["kind"] == "dead_thread"]

    assert wait_until(dead_threads, 20, "the dead-thread anomaly of attempt 1")
    (here / "go").touch()
    wait_until(lambda: "attempt 2 up" in output(run_dir), 20, "attempt 2")
    status = agent.ok("status")
    assert [r["cause"] for r in status["run"]["restarts"]] == ["crash"] and status["run"]["state"] == "running"
    assert not [a for a in status["anomalies"] if a["kind"] == "dead_thread"], status["anomalies"]
    (here / "done").touch()
    assert ended(run_dir).exit_code == 0
