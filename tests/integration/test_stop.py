"""stop and restart of a supervised run, through the real agent and real tmux on a private socket."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.agent import AgentClient, AgentPool, launch_and_wait
from support.procfs import pid_alive
from support.waiting import wait_until

from engine.host import procs
from engine.supervisor import records

pytestmark = pytest.mark.tmux


IGNORES_TERM = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # A child in the same process group that ignores SIGTERM too (SIG_IGN is inherited across exec).
    child = subprocess.Popen(["sleep", "600"])
    print("ignoring SIGTERM, child", child.pid, flush=True)
    time.sleep(600)
    """
)


def test_stop_of_a_group_that_ignores_sigterm_escalates_to_sigkill_after_the_grace(agent: AgentClient) -> None:
    launched, res, _ = launch_and_wait(agent, [sys.executable, "-c", IGNORES_TERM], "output", 20)
    assert res["ok"], res
    run_dir = Path(launched["run_dir"])
    info = records.read_run(run_dir, procs.read_boot_id())
    assert info.pid is not None
    t0 = time.monotonic()
    cmd_id = agent.send("stop", grace_s=1.0, release_timeout_s=1.0)
    reply = agent.next_event(lambda e: e.get("ev") == "reply" and e.get("id") == cmd_id, 30)
    elapsed = time.monotonic() - t0
    assert reply["ok"], reply
    result = reply["result"]
    assert result["escalated"] is True and result["stopped"] is True
    steps = result["steps"]
    assert steps[0] == f"SIGTERM to process group {info.pgid} (2 processes)"
    assert any("still alive after the 1 s grace" in s and "SIGKILL" in s for s in steps), steps
    assert any(s.startswith("killed: gone") for s in steps), steps
    assert result["exit"]["signal"] == signal.SIGKILL
    progress = [e["message"] for e in agent.events if e.get("ev") == "progress" and e.get("id") == cmd_id]
    assert progress == steps  # each step was reported as it happened
    assert 1.0 <= elapsed < 4.0, f"stop took {elapsed:.2f} s"
    assert not pid_alive(info.pid)
    ended = records.read_run(run_dir, procs.read_boot_id())
    assert (ended.state, ended.cause) == ("stopped", "stopped (SIGTERM): killed by signal 9 (SIGKILL)")


def test_stop_of_a_cooperative_job_needs_no_sigkill(agent: AgentClient) -> None:
    launched, _, _ = launch_and_wait(agent, ["sleep", "600"], "started", 20)
    t0 = time.monotonic()
    result = agent.ok("stop", grace_s=10, release_timeout_s=1)
    assert time.monotonic() - t0 < 2.0
    assert result["escalated"] is False
    assert not any("SIGKILL" in s for s in result["steps"])
    assert result["exit"]["signal"] == signal.SIGTERM
    assert result["gpu_released"] is True
    info = records.read_run(Path(launched["run_dir"]), procs.read_boot_id())
    assert info.state == "stopped" and info.signal == signal.SIGTERM  # asked for: not a failure
    assert result["exit"]["stop_requested"] == "stop" and result["exit"]["stopped"] is True


EXITS_0_ON_TERM = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as the engine does: checkpoint, then exit 0
    print("ready", flush=True)
    time.sleep(600)
    """
)


def test_a_job_that_exits_0_on_the_stops_sigterm_reads_stopped_not_exited(agent: AgentClient) -> None:
    launched, res, _ = launch_and_wait(agent, [sys.executable, "-c", EXITS_0_ON_TERM], "output", 20)
    assert res["ok"], res
    result = agent.ok("stop", grace_s=10, release_timeout_s=1)
    assert result["stopped"] is True and result["exit"]["exit_code"] == 0
    info = records.read_run(Path(launched["run_dir"]), procs.read_boot_id())
    assert (info.state, info.exit_code, info.cause) == ("stopped", 0, "stopped (SIGTERM): exited with code 0")
    listed = agent.ok("runs", limit=5)["runs"]
    assert [(r["run_id"], r["state"]) for r in listed][:1] == [(launched["run_id"], "stopped")]


@pytest.mark.parametrize(("sig", "state"), [(signal.SIGTERM, "stopped"), (signal.SIGHUP, "failed")])
def test_a_sigterm_the_wrapper_forwards_is_a_stop_but_a_sighup_is_not(
    agent: AgentClient, sig: signal.Signals, state: str
) -> None:
    launched, _, _ = launch_and_wait(agent, ["sleep", "600"], "started", 20)
    run_dir = Path(launched["run_dir"])
    wrapper_pid = (records.read_launch(run_dir) or records.LaunchRecord()).wrapper_pid
    assert wrapper_pid is not None
    os.kill(wrapper_pid, sig)
    ended = wait_until(lambda: records.read_exit(run_dir), 10, "the exit record")
    info = records.read_run(run_dir, procs.read_boot_id())
    assert (info.state, ended.signal) == (state, sig), info
    if state == "stopped":
        assert ended.stop_requested == "SIGTERM to the wrapper" and info.cause == (
            "stopped (SIGTERM): killed by signal 15 (SIGTERM)"
        )
    else:
        assert ended.stop_requested is None and "killed by signal 1 (SIGHUP)" in str(info.cause)


def test_stop_when_nothing_runs_is_a_clear_error(agent: AgentClient) -> None:
    reply = agent.request("stop", grace_s=1)
    assert reply["ok"] is False and reply["error"].startswith("no run under ")
    launch_and_wait(agent, ["true"], "first-step", 10)
    again = agent.request("stop", grace_s=1)
    assert again["ok"] is False and "is not running (exited): nothing to stop" in again["error"]


def test_restart_stops_the_run_and_launches_the_same_spec_again(pool: AgentPool) -> None:
    a = pool.make()
    first, _, _ = launch_and_wait(a, ["sleep", "600"], "started", 20, env={"MARK": "one"}, step_pattern=r"it=\d+")
    result = a.ok("restart", grace_s=5, release_timeout_s=1)
    assert result["previous_run_id"] == first["run_id"]
    assert result["stop"]["exit"]["signal"] == signal.SIGTERM
    second = result["launch"]
    assert second["run_id"] != first["run_id"]
    assert records.current_run_dir(pool.root) == Path(second["run_dir"])
    a.ok("wait", milestone="started", timeout_s=10)
    launch = records.read_json(Path(second["run_dir"]) / records.LAUNCH_JSON) or {}
    assert launch["command"] == ["sleep", "600"]
    assert launch["spec"]["env"] == {"MARK": "one"} and launch["step_pattern"] == r"it=\d+"
    assert records.read_run(Path(first["run_dir"]), procs.read_boot_id()).state == "stopped"


HOLD = "import sys, time; f = open(sys.argv[1]); print('holding', sys.argv[1], flush=True); time.sleep(600)"


def test_stop_waits_for_the_runs_gpu_devices_and_names_a_holder_that_escaped(pool: AgentPool, tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1"):
        (dev / name).write_text("")
    a = pool.make(env={"SPECDEC_DEV_DIR": str(dev)})
    script = (
        f'{sys.executable} -c "$0" {dev}/nvidia0 & '
        f'setsid {sys.executable} -c "$0" {dev}/nvidia1 & '  # leaves the process group: SIGTERM to it misses this one
        "wait"
    )
    launched, _, _ = launch_and_wait(a, ["bash", "-c", script, HOLD], "started", 20)
    log = Path(launched["run_dir"]) / "output.log"
    wait_until(lambda: log.read_text().count("holding") == 2, 10, "both holders to open their device")
    escaped = next(
        pid
        for pid in procs.tree_pids(records.read_run(Path(launched["run_dir"]), procs.read_boot_id()).pid or 0)
        if any(str(dev / "nvidia1") == os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
    )
    try:
        result = a.ok("stop", grace_s=2, release_timeout_s=1)
        assert result["gpu_released"] is False
        assert f"GPU devices still held after 1 s by pid(s) {escaped}" in result["steps"]
        assert pid_alive(escaped)
    finally:
        os.kill(escaped, signal.SIGKILL)


def test_stop_reports_the_gpu_devices_released(pool: AgentPool, tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia0").write_text("")
    a = pool.make(env={"SPECDEC_DEV_DIR": str(dev)})
    launch_and_wait(a, [sys.executable, "-c", HOLD, str(dev / "nvidia0")], "output", 20)
    result = a.ok("stop", grace_s=5, release_timeout_s=5)
    assert result["gpu_released"] is True
    assert any(s.startswith("GPU devices released (") for s in result["steps"]), result["steps"]
