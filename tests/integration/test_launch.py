"""Supervised launch through the real agent (a subprocess speaking JSON lines) and real tmux on a private socket.

The CLIENT's tests cover the same behaviour through the CLI and over SSH; these talk to the agent directly.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.supervisor import records

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]


class AgentClient:
    """The host agent as a subprocess: commands in on stdin, events out on stdout."""

    def __init__(self, run_root: Path, env: dict[str, str] | None = None) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.agent.main", "--run-root", str(run_root)],
            cwd=REPO_ROOT,
            env=full_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.events: list[dict[str, Any]] = []
        self._q: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._next_id = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()
        self.hello = self.next_event(lambda e: e.get("ev") == "hello", 20)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            ev = json.loads(line)
            self.events.append(ev)
            self._q.put(ev)
        self._q.put(None)

    def next_event(self, pred: Callable[[dict[str, Any]], bool], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching agent event within {timeout_s} s; events: {self.events[-5:]}")
            try:
                ev = self._q.get(timeout=left)
            except queue.Empty:
                continue
            if ev is None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise AssertionError(f"agent exited (rc {self.proc.poll()}): {err[-2000:]}")
            if pred(ev):
                return ev

    def send(self, cmd: str, **args: Any) -> int:
        with self._lock:
            self._next_id += 1
            cmd_id = self._next_id
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"id": cmd_id, "cmd": cmd, "args": args}) + "\n").encode())
        self.proc.stdin.flush()
        return cmd_id

    def request(self, cmd: str, reply_within_s: float = 60.0, **args: Any) -> dict[str, Any]:
        """The whole reply event of one command."""
        cmd_id = self.send(cmd, **args)
        return self.next_event(lambda e: e.get("ev") == "reply" and e.get("id") == cmd_id, reply_within_s)

    def ok(self, cmd: str, reply_within_s: float = 60.0, **args: Any) -> dict[str, Any]:
        reply = self.request(cmd, reply_within_s, **args)
        assert reply["ok"], f"{cmd} failed: {reply.get('error')}"
        result: dict[str, Any] = reply["result"]
        return result

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def poll_until(pred: Callable[[], Any], timeout_s: float = 10.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "run-root"
    r.mkdir()
    return r


@pytest.fixture
def agent_factory(root: Path) -> Iterator[Callable[..., AgentClient]]:
    """Starts agents; at teardown ends every run they launched (by its recorded process group) and the agents."""
    agents: list[AgentClient] = []

    def make(run_root: Path | None = None, env: dict[str, str] | None = None) -> AgentClient:
        a = AgentClient(run_root or root, env)
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()
    for rd in records.list_runs(root):
        launch = records.read_json(rd / records.LAUNCH_JSON) or {}
        pgid = launch.get("job_pgid")
        if isinstance(pgid, int) and records.process_alive(launch.get("job_pid"), launch.get("job_start_ticks")):
            os.killpg(pgid, signal.SIGKILL)
        sub = records.read_json(rd / records.SUBMITTED_JSON) or {}
        if sub.get("tmux_session"):
            subprocess.run(
                ["tmux", "-L", os.environ["SPECDEC_TMUX_SOCKET"], "kill-session", "-t", f"={sub['tmux_session']}"],
                capture_output=True,
                check=False,
            )


@pytest.fixture
def agent(agent_factory: Callable[..., AgentClient]) -> AgentClient:
    return agent_factory()


def launch_and_wait(
    agent: AgentClient, command: list[str], milestone: str, timeout_s: float, **spec: Any
) -> tuple[dict[str, Any], dict[str, Any], float]:
    t0 = time.monotonic()
    launched = agent.ok("launch", command=command, **spec)
    res = agent.ok("wait", run_id=launched["run_id"], milestone=milestone, timeout_s=timeout_s)
    return launched, res, time.monotonic() - t0


def test_launch_of_missing_script_fails_with_127_and_the_shells_words_within_two_seconds(agent: AgentClient) -> None:
    _, res, elapsed = launch_and_wait(agent, ["bash", "/does/not/exist.sh"], "first-step", 30)
    assert res["ok"] is False
    assert res["exit_code"] == 127
    assert any("/does/not/exist.sh: No such file or directory" in line for line in res["last_lines"]), res
    assert "127" in res["cause"]
    assert res["alive"] is False
    assert elapsed < 2.0, f"took {elapsed:.2f} s"


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
    assert res["alive"] is True
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
    info = records.read_run(Path(launched["run_dir"]), records.read_boot_id())
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
    info = records.read_run(Path(launched["run_dir"]), records.read_boot_id())
    assert info.stage == "training" and info.last_step == 1
    assert info.state == "running" and info.tmux_session == launched["tmux_session"]


def test_clashing_tmux_session_name_is_a_clear_error(agent: AgentClient, root: Path) -> None:
    sock = os.environ["SPECDEC_TMUX_SOCKET"]
    name = "specdec-clash-1"
    subprocess.run(["tmux", "-L", sock, "new-session", "-d", "-s", name, "sleep 60"], check=True)
    try:
        reply = agent.request("launch", command=["true"], run_id="clash-1")
        assert reply["ok"] is False
        assert f"tmux session '{name}' already exists" in reply["error"]
        assert not (root / "runs" / "clash-1").exists()
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-session", "-t", f"={name}"], check=False)


@pytest.mark.parametrize("blocker", ["root_is_a_file", "runs_is_a_file"])
def test_unwritable_run_root_is_a_clear_error(
    agent_factory: Callable[..., AgentClient], tmp_path: Path, blocker: str
) -> None:
    # Tests run as root, for whom mode bits do not stop a write: a file where a directory must be always does.
    if blocker == "root_is_a_file":
        bad_root = tmp_path / "not-a-dir"
        bad_root.write_text("")
        bad_root = bad_root / "root"
    else:
        bad_root = tmp_path / "root-with-file"
        bad_root.mkdir()
        (bad_root / "runs").write_text("")
    a = agent_factory(run_root=bad_root)
    reply = a.request("launch", command=["true"])
    assert reply["ok"] is False
    assert reply["error"].startswith(f"run root {bad_root} is not writable:"), reply["error"]
    assert "Not a directory" in reply["error"] or "File exists" in reply["error"]


def test_missing_working_directory_is_a_clear_error_before_anything_starts(agent: AgentClient, root: Path) -> None:
    reply = agent.request("launch", command=["true"], cwd="/does/not/exist", run_id="nocwd")
    assert reply["ok"] is False
    assert reply["error"] == "working directory /does/not/exist does not exist on the host"
    assert not (root / "runs" / "nocwd").exists()
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
    assert records.read_run(run_dir, records.read_boot_id()).state == "failed"


def test_job_survives_the_client_leaving_and_a_new_agent_finds_it(
    agent_factory: Callable[..., AgentClient], root: Path
) -> None:
    first = agent_factory()
    launched = first.ok("launch", command=["sleep", "600"])
    first.ok("wait", run_id=launched["run_id"], milestone="started", timeout_s=10)
    job_pid = records.read_run(Path(launched["run_dir"]), records.read_boot_id()).pid
    assert job_pid is not None
    first.close()  # the client leaves: stdin closes and the agent exits
    assert first.proc.returncode == 0
    assert pid_alive(job_pid)
    second = agent_factory()
    status = second.ok("status")
    run = status["run"]
    assert run is not None
    assert run["run_id"] == launched["run_id"] and run["state"] == "running" and run["pid"] == job_pid
    assert second.ok("wait", milestone="started", timeout_s=5)["ok"] is True  # no run_id: the current run
    assert records.current_run_dir(root) == Path(launched["run_dir"])


def test_without_tmux_the_run_starts_with_setsid_and_says_it_cannot_be_attached(
    agent_factory: Callable[..., AgentClient],
) -> None:
    a = agent_factory(env={"SPECDEC_NO_TMUX": "1"})
    launched, res, _ = launch_and_wait(a, ["bash", "-c", "echo hello; echo step=1; sleep 600"], "first-step", 20)
    assert launched["attachable"] is False and launched["tmux_session"] is None
    assert "not attachable" in launched["note"]
    assert res["ok"] is True
    info = records.read_run(Path(launched["run_dir"]), records.read_boot_id())
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


def test_stacks_of_a_foreign_python_job_says_what_is_missing(agent: AgentClient) -> None:
    launch_and_wait(agent, [sys.executable, "-c", "print('up', flush=True); import time; time.sleep(600)"], "output", 20)
    reply = agent.request("stacks", timeout_s=2)
    if shutil.which("py-spy"):
        assert reply["ok"] and reply["result"]["method"] == "py-spy dump"
    else:
        assert reply["ok"] is False
        assert "do not handle SIGUSR1" in reply["error"] and "py-spy is not installed" in reply["error"]


def test_invalid_run_id_and_empty_command_are_refused(agent: AgentClient) -> None:
    bad = agent.request("launch", command=["true"], run_id="../escape")
    assert bad["ok"] is False and "invalid run id" in bad["error"]
    empty = agent.request("launch", command=[])
    assert empty["ok"] is False and "non-empty list" in empty["error"]
