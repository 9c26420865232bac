"""The agent's server: one long-lived process per client connection.

Reads commands from stdin, writes events to stdout, one JSON object per line (engine/protocol/), and runs
each command's handler in a thread of its own. Which handlers exist is not known here: the caller hands in
the table (engine/agent/main.py passes engine/agent/commands.py's), so the command modules can name
``Agent`` without this module importing them.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

from engine import protocol
from engine.host import procs
from engine.supervisor.records import ScannerCache

Handler = Callable[["Agent", "int | None", dict[str, Any]], dict[str, Any]]


class CommandError(Exception):
    """A command failed for a reason the user should read (bad argument, nothing to stop, ...). ``kind``: "input"
    when the request itself was wrong (the reply's ``error_kind``; a headless client exits 2 on it)."""

    def __init__(self, message: str, *, kind: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind


# Commands that change the host (start or signal processes, write run records): the agent finishes them even when
# its client goes away mid-command, so a launch is never left half done (job running, run not recorded).
STATE_CHANGING_COMMANDS = frozenset({"launch", "stop", "kill_stale", "restart"})
# What a read-only agent (`connect --readonly`, a profile's readonly = true) refuses: every command that starts,
# stops or signals something (kill_stale only to signal: its dry run is a listing).
READONLY_REFUSED = frozenset({"launch", "stop", "restart", "kill_stale", "serve_check", "stacks"})  # stacks: signals
# How long, at stdin EOF, the agent waits for those to finish before exiting anyway.
FINISH_ON_EOF_S = 30.0
# Every other command answered before exit too (a client may write commands and close stdin at once, as
# `printf ... | agent` does); streams and waits end as soon as stopping is set, so this bound is rarely reached.
REPLY_ON_EOF_S = 5.0


class Agent:
    """Shared state of one agent process. Handlers get it as their first argument."""

    def __init__(
        self,
        run_root: Path,
        *,
        handlers: Mapping[str, Handler],
        simulate_gpus: int = 0,
        out: IO[bytes] | None = None,
        readonly: bool = False,
    ) -> None:
        """``handlers``: command name -> handler (engine/agent/commands.py's table once main imported its modules);
        ``readonly``: refuse every command that acts on a run or a process (READONLY_REFUSED)."""
        self.run_root = run_root
        self.readonly = readonly
        self.handlers: Mapping[str, Handler] = handlers
        self.simulate_gpus = simulate_gpus
        self.boot_id = procs.read_boot_id()
        self.hostname = socket.gethostname()
        self.started_at = time.time()
        self._out = out if out is not None else sys.stdout.buffer
        self._out_lock = threading.Lock()
        self.stopping = threading.Event()
        # Per-feature state that the handler modules keep on the agent (samplers, followers, ...).
        self.extras: dict[str, Any] = {}
        # The runs' incremental scanners: status, waits and stops each scan only what was appended since.
        self.scanners = ScannerCache()
        self.bad_lines = 0
        self._in_flight: set[threading.Thread] = set()  # state-changing commands still running
        self._running: set[threading.Thread] = set()  # every command still running
        self._in_flight_lock = threading.Lock()

    def emit(self, msg: dict[str, Any]) -> None:
        """Write one event line. Thread-safe; a closed stdout stops the agent."""
        data = protocol.encode(msg)
        with self._out_lock:
            try:
                self._out.write(data)
                self._out.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.stopping.set()

    def progress(self, cmd_id: int | None, message: str) -> None:
        self.emit(protocol.event("progress", id=cmd_id, message=message))

    def hello(self) -> dict[str, Any]:
        from engine.host.capabilities import probe_capabilities

        return protocol.event(
            "hello",
            protocol=protocol.PROTOCOL_VERSION,
            agent_version=protocol.AGENT_VERSION,
            hostname=self.hostname,
            boot_id=self.boot_id,
            python=sys.version.split()[0],
            python_path=sys.executable,
            pid=os.getpid(),
            run_root=str(self.run_root),
            simulated=self.simulate_gpus > 0,
            readonly=self.readonly,
            capabilities=probe_capabilities(),
            t=time.time(),
        )

    def dispatch(self, line: bytes) -> None:
        """Parse one command line and run its handler in a thread; bad input is answered, never fatal."""
        if not line.strip():
            return
        try:
            cmd_id, cmd, args = protocol.parse_command(line)
        except protocol.ProtocolError as exc:
            self.bad_lines += 1
            self.emit(protocol.event("error", message=f"bad command line #{self.bad_lines}: {exc}"))
            return
        fn = self.handlers.get(cmd)
        if fn is None:
            self.emit(
                protocol.event(
                    "reply",
                    id=cmd_id,
                    ok=False,
                    result=None,
                    error=f"unknown command {cmd!r}; known: {sorted(self.handlers)}",
                )
            )
            return
        if (
            self.readonly
            and cmd in READONLY_REFUSED
            and not (cmd == "kill_stale" and args.get("dry_run", True) is True)
        ):
            refusal = f"read-only: this agent never runs {cmd} (connect --readonly, or the profile's readonly = true)"
            self.emit(protocol.event("reply", id=cmd_id, ok=False, result=None, error=refusal))
            return
        th = threading.Thread(target=self._run, args=(fn, cmd_id, cmd, args), name=f"cmd-{cmd}", daemon=True)
        with self._in_flight_lock:
            self._running.add(th)
            if cmd in STATE_CHANGING_COMMANDS:
                self._in_flight.add(th)
        th.start()

    def finish_in_flight(self, timeout_s: float = FINISH_ON_EOF_S, *, every: bool = False) -> list[str]:
        """Wait (bounded) for the state-changing commands still running (``every``: all commands); the names of those
        that did not finish."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._in_flight_lock:
                pending = [t for t in (self._running if every else self._in_flight) if t.is_alive()]
            if not pending:
                return []
            left = deadline - time.monotonic()
            if left <= 0:
                return [t.name for t in pending]
            pending[0].join(min(left, 0.5))

    def _run(self, fn: Any, cmd_id: int | None, cmd: str, args: dict[str, Any]) -> None:
        try:
            self._call(fn, cmd_id, cmd, args)
        finally:
            with self._in_flight_lock:
                self._in_flight.discard(threading.current_thread())
                self._running.discard(threading.current_thread())

    def _call(self, fn: Any, cmd_id: int | None, cmd: str, args: dict[str, Any]) -> None:
        try:
            result = fn(self, cmd_id, args)
        except CommandError as exc:
            self.emit(protocol.event("reply", id=cmd_id, ok=False, result=None, error=str(exc), error_kind=exc.kind))
        except Exception as exc:  # a handler bug becomes a visible error reply, and the agent lives on
            tb = traceback.format_exc(limit=8)
            self.emit(
                protocol.event(
                    "reply", id=cmd_id, ok=False, result=None, error=f"{cmd}: {type(exc).__name__}: {exc}", traceback=tb
                )
            )
        else:
            self.emit(protocol.event("reply", id=cmd_id, ok=True, result=result, error=None))

    def serve(self, stdin: IO[bytes] | None = None) -> int:
        self.emit(self.hello())
        src = stdin if stdin is not None else sys.stdin.buffer
        max_line_bytes = 16 * 1024 * 1024
        while not self.stopping.is_set():
            line = src.readline(max_line_bytes)
            if not line:
                break  # client gone: stop sampling; the run itself is not ours to stop
            if len(line) >= max_line_bytes and not line.endswith(b"\n"):
                self.bad_lines += 1
                self.emit(protocol.event("error", message=f"command line over {max_line_bytes} bytes dropped"))
                while True:  # skip the rest of the over-long line
                    rest = src.readline(max_line_bytes)
                    if not rest or rest.endswith(b"\n"):
                        break
                continue
            try:
                self.dispatch(line)
            except Exception as exc:  # the agent never dies of bad input: whatever slipped past parsing is answered
                self.bad_lines += 1
                self.emit(protocol.event("error", message=f"bad command line #{self.bad_lines}: {exc!r}"[:500]))
        # A launch (or stop, ...) in flight is finished before the process exits, whether or not its reply can
        # still be delivered; waits and streams end now (stopping cancels them).
        self.stopping.set()
        unfinished = self.finish_in_flight()
        if unfinished:
            names = ", ".join(unfinished)
            sys.stderr.write(f"specdec-agent: exiting with {names} unfinished after {FINISH_ON_EOF_S:g} s\n")
        self.finish_in_flight(REPLY_ON_EOF_S, every=True)  # the replies of commands sent just before EOF
        return 0
