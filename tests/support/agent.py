"""The host agent as the tests meet it: a real ``engine.agent.main`` subprocess, commands in on stdin, events out
on stdout (one JSON object a line), and the runs it launched ended at teardown.

``AgentClient`` keeps every event it received (``events``, in order) and hands each out once through
``next_event``: an event that did not match one wait stays for the next, so a test can ask for the reply first and
the stream events after (or the other way round) without losing either.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from engine import protocol
from engine.host import procs
from engine.supervisor import records, tmux

REPO_ROOT = Path(__file__).resolve().parents[2]
Event = dict[str, Any]

HELLO_WITHIN_S = 20.0  # a cold interpreter on a busy 2-core machine imports the agent in a few seconds
CLOSE_WITHIN_S = 10.0
STDERR_TAIL_BYTES = 8192


def checkout_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment with this checkout first on PYTHONPATH (an installed copy may point at another checkout)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(extra or {})
    return env


def agent_argv(run_root: Path | str, *args: str) -> list[str]:
    """The agent's command line on ``run_root`` (``args``: more options, e.g. ``--simulate-gpus 2``)."""
    return [sys.executable, "-m", "engine.agent.main", "--run-root", str(run_root), *args]


class AgentClient:
    """A running agent: ``send``/``request``/``ok`` write commands, a reader thread collects the events."""

    def __init__(
        self,
        run_root: Path | str,
        *,
        simulate_gpus: int | None = None,
        args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        on_event: Callable[[Event], None] | None = None,
        hello_within_s: float = HELLO_WITHIN_S,
    ) -> None:
        """Start the agent and wait for its hello (``self.hello``). ``on_event`` sees every event as it arrives,
        on the reader thread (a script printing progress while it waits on a reply)."""
        extra = ["--simulate-gpus", str(simulate_gpus)] if simulate_gpus is not None else []
        self.proc = subprocess.Popen(
            agent_argv(run_root, *extra, *args),
            cwd=REPO_ROOT,
            env=checkout_env(env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.events: list[Event] = []
        self.bytes_received = 0
        self._unread: list[Event] = []
        self._ended = False
        self._fault = ""
        self._stderr = bytearray()
        self._changed = threading.Condition()
        self._next_id = 0
        self._on_event = on_event
        threading.Thread(target=self._read_events, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        self.hello = self.next_event(lambda e: e["ev"] == "hello", hello_within_s, "the agent's hello")

    def _read_events(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = protocol.parse_event(line)
            except protocol.ProtocolError as exc:  # the agent broke the protocol: every wait says so
                self._fault = f"a line that is no event ({exc}): {line[:200]!r}"
                break
            if self._on_event is not None:
                self._on_event(ev)
            with self._changed:
                self.bytes_received += len(line)
                self.events.append(ev)
                self._unread.append(ev)
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        stderr = self.proc.stderr
        for chunk in iter(lambda: stderr.read1(4096), b""):
            self._stderr.extend(chunk)
            del self._stderr[:-STDERR_TAIL_BYTES]

    @property
    def stderr_tail(self) -> str:
        """The last few KiB the agent wrote to stderr (its tracebacks)."""
        return self._stderr.decode("utf-8", "replace")

    def send_raw(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line)
        self.proc.stdin.flush()

    def send(self, cmd: str, **args: Any) -> int:
        """Write one command; its id (the reply carries it)."""
        with self._changed:
            self._next_id += 1
            cmd_id = self._next_id
        self.send_raw(protocol.encode(protocol.command(cmd_id, cmd, **args)))
        return cmd_id

    def next_event(self, pred: Callable[[Event], bool], timeout_s: float = 10.0, what: str = "event") -> Event:
        """The first unread event (already received, or arriving within ``timeout_s``) that matches ``pred``."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                for i, ev in enumerate(self._unread):
                    if pred(ev):
                        return self._unread.pop(i)
                if self._ended:
                    raise AssertionError(
                        f"the agent's output ended (rc {self.proc.poll()}) before {what}: {self._fault or 'EOF'}; "
                        f"stderr: {self.stderr_tail[-2000:]}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {what} within {timeout_s} s; last events: {self.events[-5:]}")
                self._changed.wait(left)

    def drain(self) -> list[Event]:
        """Every unread event received so far (marks them read)."""
        with self._changed:
            out, self._unread = self._unread, []
        return out

    def request(self, cmd: str, reply_within_s: float = 60.0, **args: Any) -> Event:
        """The whole reply event of one command (``ok`` false and an ``error`` when the agent refused it)."""
        cmd_id = self.send(cmd, **args)
        return self.next_event(
            lambda e: e["ev"] == "reply" and e.get("id") == cmd_id, reply_within_s, f"reply to {cmd}"
        )

    def ok(self, cmd: str, reply_within_s: float = 60.0, **args: Any) -> Any:
        """The result of a command that must succeed."""
        reply = self.request(cmd, reply_within_s, **args)
        assert reply["ok"], f"{cmd} failed: {reply.get('error')}"
        return reply["result"]

    def close(self, timeout_s: float = CLOSE_WITHIN_S) -> int:
        """End of input, as when a client goes away; the agent's exit code. An agent still alive ``timeout_s``
        later is killed, and that is an error."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)
            raise AssertionError(f"the agent did not exit within {timeout_s} s of its input closing; killed") from None


def end_runs(run_root: Path) -> None:
    """Teardown: every job launched under ``run_root`` is killed by its recorded process group (only while the job
    the record names still lives: a reused group id is never signalled), and every run's tmux session is ended."""
    for rd in records.list_runs(run_root):
        launch = records.read_json(rd / records.LAUNCH_JSON) or {}
        pgid = launch.get("job_pgid")
        if isinstance(pgid, int) and procs.process_alive(launch.get("job_pid"), launch.get("job_start_ticks")):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        submitted = records.read_json(rd / records.SUBMITTED_JSON) or {}
        session = submitted.get("tmux_session") or tmux.session_name(rd.name)
        if shutil.which("tmux") is not None:
            subprocess.run([*tmux.base_argv(), "kill-session", "-t", f"={session}"], capture_output=True, check=False)


class AgentPool:
    """Agents on one run root; ``close()`` closes them all, then ends every run they launched (``end_runs``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.agents: list[AgentClient] = []

    def make(
        self, run_root: Path | None = None, env: Mapping[str, str] | None = None, args: Iterable[str] = ()
    ) -> AgentClient:
        agent = AgentClient(run_root or self.root, env=env, args=args)
        self.agents.append(agent)
        return agent

    def close(self) -> None:
        unclean: list[str] = []
        for agent in self.agents:
            try:
                agent.close()
            except AssertionError as exc:
                unclean.append(str(exc))
        end_runs(self.root)
        assert not unclean, unclean


def launch_and_wait(
    agent: AgentClient, command: list[str], milestone: str, timeout_s: float, **spec: Any
) -> tuple[Event, Event, float]:
    """``launch`` then ``wait`` for ``milestone``: (launch result, wait result, seconds both took)."""
    t0 = time.monotonic()
    launched = agent.ok("launch", command=command, **spec)
    res = agent.ok("wait", run_id=launched["run_id"], milestone=milestone, timeout_s=timeout_s)
    return launched, res, time.monotonic() - t0
