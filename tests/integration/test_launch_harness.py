"""Harness for the supervisor's integration tests (no tests here): the agent as a subprocess, and a pool
of agents whose runs are ended at teardown by their recorded process groups.

test_launch*.py, test_stop*.py and test_kill_stale*.py import it (pytest puts this folder on sys.path).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.host import procs
from engine.supervisor import records

REPO_ROOT = Path(__file__).resolve().parents[2]


class AgentClient:
    """The host agent as a subprocess: commands in on stdin, events out on stdout."""

    def __init__(
        self,
        run_root: Path,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "engine.agent.main", "--run-root", str(run_root), *(args or [])],
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


class AgentPool:
    """Starts agents on one run root; close() ends every run they launched (by its recorded process group,
    identity checked) and their tmux sessions, then the agents."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.agents: list[AgentClient] = []

    def make(
        self,
        run_root: Path | None = None,
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        prefix: list[str] | None = None,
    ) -> AgentClient:
        a = AgentClient(run_root or self.root, env, args, prefix)
        self.agents.append(a)
        return a

    def close(self) -> None:
        for a in self.agents:
            a.close()
        for rd in records.list_runs(self.root):
            launch = records.read_json(rd / records.LAUNCH_JSON) or {}
            pgid = launch.get("job_pgid")
            if isinstance(pgid, int) and procs.process_alive(launch.get("job_pid"), launch.get("job_start_ticks")):
                os.killpg(pgid, signal.SIGKILL)
            sub = records.read_json(rd / records.SUBMITTED_JSON) or {}
            if sub.get("tmux_session"):
                subprocess.run(
                    ["tmux", "-L", os.environ["SPECDEC_TMUX_SOCKET"], "kill-session", "-t", f"={sub['tmux_session']}"],
                    capture_output=True,
                    check=False,
                )


def launch_and_wait(
    agent: AgentClient, command: list[str], milestone: str, timeout_s: float, **spec: Any
) -> tuple[dict[str, Any], dict[str, Any], float]:
    t0 = time.monotonic()
    launched = agent.ok("launch", command=command, **spec)
    res = agent.ok("wait", run_id=launched["run_id"], milestone=milestone, timeout_s=timeout_s)
    return launched, res, time.monotonic() - t0
