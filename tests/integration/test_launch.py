"""Supervised launch through the real agent (a subprocess speaking JSON lines) and real tmux on a private socket.

The CLIENT's tests cover the same behaviour through the CLI and over SSH; these talk to the agent directly.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.agent import REPO_ROOT, AgentClient, AgentPool, launch_and_wait
from support.procfs import pid_alive
from support.waiting import wait_until

from engine.host import procs
from engine.supervisor import records, tmux

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]


def test_launch_of_missing_script_fails_with_127_and_the_shells_words_within_two_seconds(agent: AgentClient) -> None:
    _, res, elapsed = launch_and_wait(agent, ["bash", "/does/not/exist.sh"], "first-step", 30)
    assert res["ok"] is False
    assert res["exit_code"] == 127
    assert any("/does/not/exist.sh: No such file or directory" in line for line in res["last_lines"]), res
    assert "127" in res["cause"]
    assert res["alive"] is False and res["hung"] is False
    assert elapsed < 2.0, f"took {elapsed:.2f} s"


def test_a_job_that_writes_its_output_to_another_file_is_named_with_that_file(
    agent: AgentClient, tmp_path: Path
) -> None:
    """`exec > other.log` in a script: output.log stays empty, so the job read "alive and silent" with no clue."""
    other = tmp_path / "other.log"
    script = 'exec > "$1" 2>&1; echo "step=1"; exec sleep 600'
    launched, res, _ = launch_and_wait(agent, ["sh", "-c", script, "sh", str(other)], "output", 3)
    try:
        assert res["ok"] is False and res["alive"] is True and res["hung"] is True, res
        assert f"its output goes to {other} (stdout of pid " in res["cause"], res["cause"]
    finally:
        agent.ok("stop", run_id=launched["run_id"], grace_s=5, release_timeout_s=1)


def test_python_raising_at_import_reports_the_traceback(agent: AgentClient, tmp_path: Path) -> None:
    (tmp_path / "broken_mod.py").write_text("raise RuntimeError('broken at import time')\n")
    _, res, _ = launch_and_wait(agent, [sys.executable, "-c", "import broken_mod"], "first-step", 30, cwd=str(tmp_path))
    assert res["ok"] is False
    assert res["exit_code"] == 1
    text = "\n".join(res["last_lines"])
    assert "Traceback (most recent call last)" in text
    assert "RuntimeError: broken at import time" in text


def test_silent_sleep_is_reported_hung_alive_and_silent_within_five_seconds(agent: AgentClient) -> None:
    launched, res, elapsed = launch_and_wait(agent, ["sleep", "600"], "output", 3)
    assert res["ok"] is False
    assert res["alive"] is True and res["hung"] is True
    assert res["exit_code"] is None and res["signal"] is None
    assert "alive, silent" in res["detail"]
    assert "thread" in res["detail"] and "CPU" in res["detail"]
    assert "hung" in res["cause"]
    assert res["stage"] == "started"
    assert 3.0 <= elapsed < 5.0, f"took {elapsed:.2f} s"
    stopped = agent.ok("stop", run_id=launched["run_id"], grace_s=5, release_timeout_s=1)
    assert stopped["stopped"] is True


def test_deadline_from_the_spec_ends_the_wait_as_hung(agent: AgentClient) -> None:
    _, res, elapsed = launch_and_wait(agent, ["sleep", "600"], "first-step", 60, deadlines_s={"output": 1.0})
    assert res["ok"] is False and res["alive"] is True
    assert "output deadline of 1 s" in res["cause"]
    assert elapsed < 3.0


def test_job_killed_by_a_signal_reports_the_signal(agent: AgentClient) -> None:
    _, res, elapsed = launch_and_wait(agent, ["bash", "-c", "echo about to die; kill -KILL $$"], "first-step", 30)
    assert res["ok"] is False
    assert res["signal"] == 9
    assert res["exit_code"] is None
    assert "SIGKILL" in res["cause"]
    assert "about to die" in res["last_lines"]
    assert elapsed < 2.0


def test_first_step_from_a_log_line_matching_the_step_pattern(agent: AgentClient) -> None:
    cmd = ["bash", "-c", "echo loading; echo 'iter 1 step=1 loss=3.2'; sleep 600"]
    launched, res, _ = launch_and_wait(agent, cmd, "first-step", 20)
    assert res["ok"] is True, res
    assert res["alive"] is True
    info = records.read_run(Path(launched["run_dir"]), procs.read_boot_id())
    ms = info.milestones
    assert ms["submitted"] and ms["started"] and ms["output"] and ms["first-step"]
    assert ms["submitted"] <= ms["started"] + 0.5 and ms["started"] <= ms["output"] <= ms["first-step"] + 0.1
    milestones_seen = {e["milestone"] for e in agent.events if e.get("ev") == "milestone" and e.get("ok")}
    assert milestones_seen == {"submitted", "started", "output", "first-step"}


def test_first_step_from_an_engine_step_event_and_custom_pattern_not_matched(agent: AgentClient) -> None:
    script = textwrap.dedent(
        """
        import json, os, time
        print("custom progress 7/100", flush=True)
        with open(os.environ["SPECDEC_EVENTS"], "a") as fh:
            fh.write(json.dumps({"t": time.time(), "kind": "stage", "stage": "training", "thread": None,
                                 "detail": ""}) + "\\n")
            fh.write(json.dumps({"t": time.time(), "kind": "step", "thread": "drafter-0", "step": 1, "loss": [1.0],
                                 "acc": [0.1], "tok_s": 1.0, "ms": {}}) + "\\n")
        time.sleep(600)
        """
    )
    launched, res, _ = launch_and_wait(
        agent, [sys.executable, "-c", script], "first-step", 20, step_pattern=r"never-matches-\d+"
    )
    assert res["ok"] is True, res
    info = records.read_run(Path(launched["run_dir"]), procs.read_boot_id())
    assert info.stage == "training" and info.last_step == 1
    assert info.state == "running" and info.tmux_session == launched["tmux_session"]


def test_clashing_tmux_session_name_is_a_clear_error(agent: AgentClient, pool: AgentPool) -> None:
    sock = os.environ["SPECDEC_TMUX_SOCKET"]
    name = "specdec-clash-1"
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-s", name, "sleep 60"], check=True)
    try:
        reply = agent.request("launch", command=["true"], run_id="clash-1")
        assert reply["ok"] is False
        assert f"tmux session '{name}' already exists" in reply["error"]
        assert not (pool.root / "runs" / "clash-1").exists()
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-session", "-t", f"={name}"], check=False)


@pytest.mark.parametrize("blocker", ["root_is_a_file", "runs_is_a_file", "immutable_root"])
def test_unwritable_run_root_is_a_clear_error(pool: AgentPool, tmp_path: Path, blocker: str) -> None:
    # Tests run as root, for whom mode bits do not stop a write: a file where a directory must be, or an
    # immutable directory (chattr +i, where the filesystem supports it), really do.
    if blocker == "root_is_a_file":
        bad_root = tmp_path / "not-a-dir"
        bad_root.write_text("")
        bad_root = bad_root / "root"
        expected = "Not a directory"
    elif blocker == "runs_is_a_file":
        bad_root = tmp_path / "root-with-file"
        bad_root.mkdir()
        (bad_root / "runs").write_text("")
        expected = "File exists"
    else:
        bad_root = tmp_path / "immutable"
        bad_root.mkdir()
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(bad_root)]).returncode != 0:
            pytest.skip("chattr +i is not supported here")
        expected = "Operation not permitted" if os.geteuid() == 0 else "Permission denied"
    try:
        a = pool.make(run_root=bad_root)
        reply = a.request("launch", command=["true"])
    finally:
        if blocker == "immutable_root":
            subprocess.run(["chattr", "-i", str(bad_root)], check=True)
    assert reply["ok"] is False
    assert reply["error"].startswith(f"run root {bad_root} is not writable: {expected}"), reply["error"]
    assert reply.get("error_kind") is None  # the request was fine; the host could not carry it out (exit 1)


def test_missing_working_directory_is_a_clear_error_before_anything_starts(agent: AgentClient, pool: AgentPool) -> None:
    reply = agent.request("launch", command=["true"], cwd="/does/not/exist", run_id="nocwd")
    assert reply["ok"] is False
    assert reply["error"] == "working directory /does/not/exist does not exist on the host"
    assert reply["error_kind"] == "input"  # the request was wrong: a headless client exits 2
    assert not (pool.root / "runs" / "nocwd").exists()
    res = subprocess.run(
        ["tmux", "-L", os.environ["SPECDEC_TMUX_SOCKET"], "has-session", "-t", "=specdec-nocwd"], capture_output=True
    )
    assert res.returncode != 0


def test_wrapper_records_a_working_directory_that_vanished_after_the_check(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "gone-cwd"
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"run_id": "gone-cwd", "spec": {"command": ["true"], "cwd": str(tmp_path / "gone")}}))
    res = subprocess.run(
        [sys.executable, "-m", "engine.supervisor.wrapper", "--run-dir", str(run_dir), "--spec-json", str(spec)],
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=30,
    )
    assert res.returncode == 1
    assert res.stdout == b"" and res.stderr == b""  # everything went to output.log
    log = (run_dir / "output.log").read_text()
    assert f"working directory {tmp_path / 'gone'} does not exist" in log
    exit_rec = json.loads((run_dir / "exit.json").read_text())
    assert exit_rec["exit_code"] == 1 and "does not exist" in exit_rec["cause"]
    assert json.loads((run_dir / "launch.json").read_text())["cwd"] == str(tmp_path / "gone")
    assert records.read_run(run_dir, procs.read_boot_id()).state == "failed"


def test_job_survives_the_client_leaving_and_a_new_agent_finds_it(pool: AgentPool) -> None:
    first = pool.make()
    launched = first.ok("launch", command=["sleep", "600"])
    first.ok("wait", run_id=launched["run_id"], milestone="started", timeout_s=10)
    job_pid = records.read_run(Path(launched["run_dir"]), procs.read_boot_id()).pid
    assert job_pid is not None
    first.close()  # the client leaves: stdin closes and the agent exits
    assert first.proc.returncode == 0
    assert pid_alive(job_pid)
    second = pool.make()
    status = second.ok("status")
    run = status["run"]
    assert run is not None
    assert run["run_id"] == launched["run_id"] and run["state"] == "running" and run["pid"] == job_pid
    assert second.ok("wait", milestone="started", timeout_s=5)["ok"] is True  # no run_id: the current run
    assert records.current_run_dir(pool.root) == Path(launched["run_dir"])


def test_without_tmux_the_run_starts_with_setsid_and_says_it_cannot_be_attached(pool: AgentPool) -> None:
    a = pool.make(env={"SPECDEC_NO_TMUX": "1"})
    launched, res, _ = launch_and_wait(a, ["bash", "-c", "echo hello; echo step=1; sleep 600"], "first-step", 20)
    assert launched["attachable"] is False and launched["tmux_session"] is None
    assert "not attachable" in launched["note"]
    assert res["ok"] is True
    info = records.read_run(Path(launched["run_dir"]), procs.read_boot_id())
    assert info.attachable is False and info.state == "running"
    stopped = a.ok("stop", grace_s=5, release_timeout_s=1)
    assert stopped["escalated"] is False
    assert stopped["exit"]["signal"] == signal.SIGTERM


def test_stacks_of_a_job_with_faulthandler_on_sigusr1(agent: AgentClient) -> None:
    script = textwrap.dedent(
        """
        import faulthandler, signal, sys, threading, time
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
        def worker_loop():
            time.sleep(600)
        threading.Thread(target=worker_loop, name="drafter-0", daemon=True).start()
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    launch_and_wait(agent, [sys.executable, "-c", script], "output", 20)
    res = agent.ok("stacks", timeout_s=5)
    assert "faulthandler" in res["method"]
    assert "worker_loop" in res["text"], res["text"]
    assert res["text"].count("Thread 0x") + res["text"].count("Current thread 0x") >= 2, res["text"]


FOREIGN_SLEEPER = [sys.executable, "-c", "print('up', flush=True); import time; time.sleep(600)"]


def test_stacks_of_a_foreign_python_job_come_from_the_wrappers_hook_without_py_spy(agent: AgentClient) -> None:
    launched, _, _ = launch_and_wait(agent, FOREIGN_SLEEPER, "output", 20)
    reply = agent.request("stacks", timeout_s=5)
    try:
        assert reply["ok"], reply
        result = reply["result"]
        assert result["method"].startswith("SIGUSR1 to pid") and "Thread MainThread" in result["text"], result
    finally:
        agent.ok("stop", run_id=launched["run_id"], grace_s=5, release_timeout_s=1)


def test_stacks_of_a_foreign_python_job_without_the_hook_says_what_is_missing(agent: AgentClient) -> None:
    launch_and_wait(agent, FOREIGN_SLEEPER, "output", 20, env={"SPECDEC_STACK_HOOK": "0"})
    reply = agent.request("stacks", timeout_s=2)
    if shutil.which("py-spy"):
        assert reply["ok"] and reply["result"]["method"] == "py-spy dump"
    else:
        assert reply["ok"] is False
        assert "do not handle SIGUSR1" in reply["error"] and "py-spy is not installed" in reply["error"]


def test_stacks_never_fires_a_jobs_own_sigusr1_handler(agent: AgentClient, tmp_path: Path) -> None:
    """A job that takes SIGUSR1 for itself (a save-and-exit on pre-emption) is not asked for a dump with it."""
    fired = tmp_path / "fired"
    script = textwrap.dedent(
        f"""
        import signal, time
        signal.signal(signal.SIGUSR1, lambda *a: open({str(fired)!r}, "w").close())
        print("ready", flush=True)
        time.sleep(600)
        """
    )
    launched, _, _ = launch_and_wait(agent, [sys.executable, "-c", script], "output", 20)
    try:
        reply = agent.request("stacks", timeout_s=5)
        if shutil.which("py-spy"):
            assert reply["ok"] and reply["result"]["method"] == "py-spy dump", reply
        else:
            assert reply["ok"] is False and "handle SIGUSR1 themselves" in reply["error"], reply
        time.sleep(0.5)  # a signal sent would have run the handler by now: nothing to wait on when none was
        assert not fired.exists(), "stacks fired the job's own SIGUSR1 handler"
    finally:
        agent.ok("stop", run_id=launched["run_id"], grace_s=5, release_timeout_s=1)


def test_invalid_run_id_and_empty_command_are_refused(agent: AgentClient) -> None:
    bad = agent.request("launch", command=["true"], run_id="../escape")
    assert bad["ok"] is False and "invalid run id" in bad["error"]
    empty = agent.request("launch", command=[])
    assert empty["ok"] is False and "non-empty list" in empty["error"]


def test_the_tmux_pane_shows_the_runs_output_and_its_end(agent: AgentClient) -> None:
    launched, res, _ = launch_and_wait(agent, ["bash", "-c", "echo first line; echo second line; exit 3"], "output", 20)
    assert res["ok"] is True

    def pane() -> str:
        done = subprocess.run(
            [*tmux.base_argv(), "capture-pane", "-p", "-S", "-", "-t", f"={launched['tmux_session']}:"],
            capture_output=True,
            text=True,
            check=False,
        )
        return done.stdout if "exited with code 3" in done.stdout else ""

    text = wait_until(pane, 10, "the pane to show the run's end")
    assert "first line\nsecond line\n" in text
    assert f"[specdec] run {launched['run_id']} exited with code 3" in text


def test_a_command_that_does_not_exist_fails_with_127_and_says_so(agent: AgentClient) -> None:
    _, res, elapsed = launch_and_wait(agent, ["no-such-command-xyz", "--flag"], "first-step", 30)
    assert res["ok"] is False and res["exit_code"] == 127
    assert "specdec: cannot start run" in res["last_lines"][-1]
    assert "cannot run 'no-such-command-xyz': No such file or directory" in res["last_lines"][-1]
    assert res["stage"] == "submitted"  # the job never existed
    assert elapsed < 2.0


def test_reusing_a_run_id_is_refused_and_the_first_run_is_untouched(pool: AgentPool) -> None:
    for env in ({}, {"SPECDEC_NO_TMUX": "1"}):
        a = pool.make(env=env)
        run_id = f"dup-{len(env)}"
        launch_and_wait(a, ["true"], "first-step", 10, run_id=run_id)
        first_launch = (pool.root / "runs" / run_id / "launch.json").read_bytes()
        again = a.request("launch", command=["true"], run_id=run_id)
        assert again["ok"] is False and "already exists" in again["error"], again
        assert (pool.root / "runs" / run_id / "launch.json").read_bytes() == first_launch
