"""The launch wrapper: ``python3 -m engine.supervisor.wrapper --run-dir D --spec-json FILE``.

Started by the agent inside a new tmux session (or a new ``setsid`` session when tmux is missing).
In this order it: creates the run directory; points its own stdout and stderr at ``output.log``
(so a job that dies in ``cd``, a missing script or an import still leaves its words there);
leads its own process group; writes ``launch.json``; enters the working directory; starts the job
in a new session (its own process group, stdin from /dev/null) with SPECDEC_RUN_DIR,
SPECDEC_EVENTS and SPECDEC_RUN_ID set; forwards SIGTERM, SIGINT and SIGHUP to the job's group;
times the first output and the first step (``milestones.json``); and writes ``exit.json``
atomically when the job ends (into space reserved before the job started when the disk is full by
then). It survives SIGHUP itself, so neither a closing SSH or ``pct exec`` channel nor a killed
tmux session leaves the run without its exit record. It never uses nohup.

Stdlib only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from engine import protocol
from engine.supervisor import records

POLL_S = 0.05  # milestone timing and exit detection resolution
ECHO_POLL_S = 0.1  # once every milestone is timed: only the pane echo is left
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def say(text: str) -> None:
    """A line on our stderr (output.log): lost, never fatal, when the run root's disk is full."""
    with contextlib.suppress(OSError):
        sys.stderr.write(text + "\n")
        sys.stderr.flush()


class Wrapper:
    def __init__(self, run_dir: Path, doc: dict[str, Any], pane_fd: int | None) -> None:
        self.run_dir = run_dir
        self.doc = doc
        spec = doc.get("spec") or {}
        self.spec = spec
        self.run_id = str(doc.get("run_id") or run_dir.name)
        self.command = [str(a) for a in spec.get("command") or []]
        self.cwd = spec.get("cwd") or os.path.expanduser("~")
        self.pane_fd = pane_fd
        self.job: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []  # signals that arrived before the job existed
        self.forwarded: list[dict[str, Any]] = []
        self.launch: dict[str, Any] = {}

    # -- signals ---------------------------------------------------------------------------------
    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        job = self.job
        if job is None:
            self.pending.append(signum)
            return
        self.forwarded.append({"signal": signum, "name": records.signal_name(signum), "t": time.time()})
        # The group may be gone already; the exit record will say how it ended.
        with contextlib.suppress(OSError):
            os.killpg(job.pid, signum)

    # -- records ---------------------------------------------------------------------------------
    def write_launch(self, **extra: Any) -> None:
        self.launch.update(extra)
        records.write_json_atomic(self.run_dir / records.LAUNCH_JSON, self.launch, mode=0o600)

    def write_exit(self, exit_code: int | None, sig: int | None, cause: str) -> None:
        rec = {
            "run_id": self.run_id,
            "exit_code": exit_code,
            "signal": sig,
            "signal_name": records.signal_name(sig) if sig is not None else None,
            "ended_at": time.time(),
            "cause": cause,
            "forwarded_signals": self.forwarded,
        }
        records.write_exit_record(self.run_dir, rec)

    def write_milestones(self, milestones: dict[str, float]) -> None:
        # A full disk loses only this record: readers then time the milestones from output.log and events.jsonl.
        try:
            records.write_json_atomic(self.run_dir / records.MILESTONES_JSON, milestones)
        except OSError as exc:
            say(f"specdec: cannot record milestones: {exc.strerror or exc}")

    def fail_before_start(self, exit_code: int, cause: str) -> int:
        say(f"specdec: cannot start run {self.run_id}: {cause}")
        self.write_exit(exit_code, None, cause)
        self.echo_status(f"[specdec] run {self.run_id} did not start: {cause}")
        return exit_code

    def echo_status(self, text: str) -> None:
        if self.pane_fd is not None:
            try:
                os.write(self.pane_fd, f"\r\n{text}\r\n".encode())
            except OSError:
                self.pane_fd = None

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> int:
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self.on_signal)
        try:
            out_size = os.fstat(1).st_size
        except OSError:
            out_size = 0
        now = time.time()
        self.launch = {
            "run_id": self.run_id,
            "command": self.command,
            "cwd": self.cwd,
            "pid": os.getpid(),
            "pgid": os.getpgid(0),
            "wrapper_pid": os.getpid(),
            "wrapper_start_ticks": records.start_ticks_of(os.getpid()),
            "boot_id": records.read_boot_id(),
            "hostname": socket.gethostname(),
            "started_at": now,
            "tmux_session": self.doc.get("tmux_session"),
            "attachable": bool(self.doc.get("attachable")),
            "step_pattern": self.spec.get("step_pattern") or r"step=\d+",
            "deadlines_s": self.spec.get("deadlines_s") or {},
            "profile": self.spec.get("profile"),
            "spec": self.spec,
            "output_offset_at_start": out_size,
            "python": sys.executable,
        }
        self.write_launch()
        if not records.reserve_exit_record(self.run_dir):
            say("specdec: no room to reserve the exit record; it is written only if room is left")
        if not self.command:
            return self.fail_before_start(2, "the launch spec has an empty command")
        if self.pending:
            first = self.pending[0]
            self.write_exit(None, first, f"{records.signal_name(first)} arrived before the job started; not started")
            return 128 + first
        try:
            os.chdir(self.cwd)
        except OSError as exc:
            what = "does not exist" if exc.errno == errno.ENOENT else f"cannot be entered: {exc.strerror}"
            return self.fail_before_start(1, f"working directory {self.cwd} {what}")
        env = dict(os.environ)
        env.pop("TMUX", None)
        env.pop("TMUX_PANE", None)
        env.setdefault("PYTHONUNBUFFERED", "1")  # a Python job's words reach output.log as it says them
        env.update({str(k): str(v) for k, v in (self.spec.get("env") or {}).items()})
        env[protocol.ENV_RUN_DIR] = str(self.run_dir)
        env[protocol.ENV_EVENTS_PATH] = str(self.run_dir / records.EVENTS_JSONL)
        env[protocol.ENV_RUN_ID] = self.run_id
        try:
            job = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
                start_new_session=True,  # its own session and process group: stop signals exactly the job
            )
        except OSError as exc:
            code = 127 if exc.errno == errno.ENOENT else 126
            return self.fail_before_start(code, f"cannot run {self.command[0]!r}: {exc.strerror or exc}")
        self.job = job
        self.write_launch(
            job_pid=job.pid,
            job_pgid=job.pid,
            job_start_ticks=records.start_ticks_of(job.pid),
            job_started_at=time.time(),
        )
        for pending_sig in self.pending:  # arrived between the check and Popen
            self.on_signal(pending_sig, None)
        return self.supervise(job, out_size)

    def supervise(self, job: subprocess.Popen[bytes], out_base: int) -> int:
        scanner = records.RunScanner(self.run_dir, self.launch["step_pattern"], out_base)
        milestones: dict[str, float] = {}
        echo_offset = out_base
        status: int | None = None
        while status is None:
            pid, raw = os.waitpid(job.pid, os.WNOHANG)
            if pid == job.pid:
                status = raw
                break
            now = time.time()
            if len(milestones) < 2:
                st = scanner.poll(now)
                changed = False
                if "output" not in milestones and st.output_seen_at is not None:
                    milestones["output"] = st.output_seen_at
                    changed = True
                first_step = st.first_step_t or st.log_step_seen_at
                if "first-step" not in milestones and first_step is not None:
                    milestones["first-step"] = first_step
                    changed = True
                if changed:
                    self.write_milestones(milestones)
            echo_offset = self.echo(echo_offset)
            if len(milestones) == 2 and self.pane_fd is None:
                _, status = os.waitpid(job.pid, 0)  # nothing left to watch: block until the job ends
                break
            time.sleep(POLL_S if len(milestones) < 2 else ECHO_POLL_S)
        job.returncode = os.waitstatus_to_exitcode(status)
        self._final_milestones(scanner, milestones)  # before exit.json: a reader that sees the end sees these
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            cause = f"killed by signal {sig} ({records.signal_name(sig)})"
            self.write_exit(None, sig, cause)
            code = 128 + sig
        else:
            code = os.WEXITSTATUS(status)
            self.write_exit(code, None, f"exited with code {code}")
            cause = f"exited with code {code}"
        self.echo(echo_offset)
        self.echo_status(f"[specdec] run {self.run_id} {cause}")
        return code

    def _final_milestones(self, scanner: records.RunScanner, milestones: dict[str, float]) -> None:
        # A job that printed and died within one poll still gets its output milestone recorded.
        if len(milestones) == 2:
            return
        st = scanner.poll()
        before = dict(milestones)
        if st.output_seen_at is not None:
            milestones.setdefault("output", st.output_seen_at)
        first_step = st.first_step_t or st.log_step_seen_at
        if first_step is not None:
            milestones.setdefault("first-step", first_step)
        if milestones != before:
            self.write_milestones(milestones)

    def echo(self, offset: int) -> int:
        """Copy what the job appended to output.log into the tmux pane, so attaching shows the run."""
        if self.pane_fd is None:
            return offset
        try:
            with open(self.run_dir / records.OUTPUT_LOG, "rb") as fh:
                fh.seek(offset)
                data = fh.read(256 * 1024)
        except OSError:
            return offset
        if not data:
            return offset
        try:
            written = os.write(self.pane_fd, data)  # the pty's ONLCR turns \n into \r\n
        except BlockingIOError:
            return offset  # nobody drains the pane right now: try again next poll rather than stall
        except OSError:
            self.pane_fd = None  # the pane is gone (tmux killed): supervision goes on
            return offset
        return offset + written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec-wrapper", description="run one job under supervision")
    parser.add_argument("--run-dir", required=True, type=Path)
    parser.add_argument("--spec-json", required=True, type=Path)
    parser.add_argument("--echo-to-pane", action="store_true", help="copy the job's output to our terminal too")
    ns = parser.parse_args(argv)
    run_dir: Path = ns.run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    pane_fd = os.dup(1) if ns.echo_to_pane and os.isatty(1) else None
    log_fd = os.open(run_dir / records.OUTPUT_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the forwarding handler is in place
    if pane_fd is not None:
        os.set_blocking(pane_fd, False)
    if os.getpgid(0) != os.getpid():
        with contextlib.suppress(OSError):  # a session leader already leads its group
            os.setpgid(0, 0)
    try:
        with open(ns.spec_json, "rb") as fh:
            doc = json.loads(fh.read())
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"specdec: cannot read the launch spec {ns.spec_json}: {exc}\n")
        records.write_json_atomic(
            run_dir / records.EXIT_JSON,
            {"exit_code": 2, "signal": None, "ended_at": time.time(), "cause": f"unreadable launch spec: {exc}"},
        )
        return 2
    return Wrapper(run_dir, doc, pane_fd).run()


if __name__ == "__main__":
    sys.exit(main())
