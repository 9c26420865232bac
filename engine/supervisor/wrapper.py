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

Under a restart policy (the spec's ``restart``, engine/supervisor/restart.py) it starts the job again
after a crash, a hang (stacks dumped, then stopped) or a CUDA OOM, as attempt 2, 3, ... of the same
run (SPECDEC_ATTEMPT), recording each restart in ``restarts.json``; exit.json is written once, at the
very end. SIGUSR2 from ``stop`` (and any signal it forwards) cancels the policy and marks the run as asked to
stop: when it then ends cleanly (torchrun: every rank's run_end ok, though torchrun itself exits 1 on SIGTERM),
exit.json says ``stopped`` and the run reads as stopped, not failed.

Stdlib only.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

from engine import protocol, stackdump
from engine.host import disk, procs
from engine.supervisor import records, restart, stack_hook, stacks
from engine.supervisor.common import SupervisorError
from engine.supervisor.members import signal_group_checked
from engine.supervisor.records import ExitRecord, LaunchRecord

POLL_S = 0.05  # milestone timing and exit detection resolution
ECHO_POLL_S = 0.1  # once every milestone is timed: only the pane echo is left
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_REQUEST_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # forwarded on a person's request: the run was stopped
CANCEL_SIGNAL = signal.SIGUSR2  # from `stop`: cancel the restart policy (never forwarded to the job)
HANG_DUMP_TIMEOUT_S = 5.0
KILL_WAIT_S = 5.0  # after SIGKILL, how long the ended attempt's processes may take to leave the table


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
        self.step_pattern: str = spec.get("step_pattern") or r"step=\d+"
        self.pane_fd = pane_fd
        self.job: subprocess.Popen[bytes] | None = None  # the live attempt's job; None between attempts
        self.pending: list[int] = []  # signals that arrived while no job existed
        self.forwarded: list[dict[str, Any]] = []
        self.signals_seen: list[int] = []  # every forwarded-kind signal the wrapper got: each cancels the policy
        self.cancel_reason: str | None = None  # set by `stop` (CANCEL_SIGNAL): restart nothing after this
        self.launch = LaunchRecord()
        self.policy: protocol.Policy | None = None
        self.attempt = 0
        self.restarts: list[dict[str, Any]] = []
        self.restart_state = "watching"
        self.env: dict[str, str] = {}
        self.milestones: dict[str, float] = {}
        self.echo_offset = 0
        self.next_restart: dict[str, Any] | None = None  # the restart entry the next attempt completes

    # -- signals ---------------------------------------------------------------------------------
    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals_seen.append(signum)
        if self.job is None:
            self.pending.append(signum)
            return
        self.forward(signum)

    def forward(self, signum: int) -> None:
        job = self.job
        if job is None:
            return
        self.forwarded.append({"signal": signum, "name": records.signal_name(signum), "t": time.time()})
        # The group may be gone already; the exit record will say how it ended.
        with contextlib.suppress(OSError):
            os.killpg(job.pid, signum)

    def on_cancel(self, signum: int, frame: FrameType | None) -> None:
        self.cancel_reason = "stop"

    def stop_request(self) -> tuple[str, str] | None:
        """(who asked, the signal the job got) once the run was asked to stop: `stop` (which then sends SIGTERM to
        the job's processes itself), or a SIGTERM or SIGINT to the wrapper that it forwarded (a SIGHUP is a closed
        terminal, not a request); None while nobody asked."""
        if self.cancel_reason == "stop":
            return "stop", "SIGTERM"
        asked = [s for s in self.signals_seen if s in STOP_REQUEST_SIGNALS]
        if asked:
            name = records.signal_name(asked[0])
            return f"{name} to the wrapper", name
        return None

    def cancelled(self) -> str | None:
        """Why the restart policy no longer applies (a stop, or a signal to the wrapper); None while it does."""
        if self.cancel_reason is not None:
            return self.cancel_reason
        if self.signals_seen:
            return f"{records.signal_name(self.signals_seen[0])} to the wrapper"
        return None

    def _reap(self, pid: int, block: bool = False) -> int | None:
        """The job's wait status once it has ended (None while it runs); self.job is cleared in the same breath,
        so a signal handled after the reap can never reach a process group whose id was reused."""
        if block:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # until it is a zombie, still unreaped
        old = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED_SIGNALS)
        try:
            got, raw = os.waitpid(pid, os.WNOHANG)
            if got != pid:
                return None
            self.job = None
            return raw
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    # -- records ---------------------------------------------------------------------------------
    def write_launch(self) -> None:
        records.write_json_atomic(self.run_dir / records.LAUNCH_JSON, self.launch.to_json(), mode=0o600)

    def write_exit(
        self, exit_code: int | None, sig: int | None, cause: str, root: str | None = None, stopped: bool = False
    ) -> None:
        """exit.json; ``root``: the last attempt's own root cause (records.ROOT_CAUSE_KEY), when one is known;
        ``stopped``: the job ended because it was asked to stop, cleanly."""
        asked = self.stop_request()
        rec = ExitRecord(
            run_id=self.run_id,
            exit_code=exit_code,
            signal=sig,
            signal_name=records.signal_name(sig) if sig is not None else None,
            ended_at=time.time(),
            cause=cause,
            forwarded_signals=self.forwarded,
            stop_requested=asked[0] if asked is not None else None,
            stopped=True if stopped else None,
        )
        if self.policy is not None:
            rec.attempts, rec.restarts, rec.restart_state = self.attempt, self.restarts, self.restart_state
        if root:
            rec.extra[records.ROOT_CAUSE_KEY] = root
        records.write_exit_record(self.run_dir, rec)

    def write_milestones(self, milestones: dict[str, float]) -> None:
        # A full disk loses only this record: readers then time the milestones from output.log and events.jsonl.
        try:
            records.write_json_atomic(self.run_dir / records.MILESTONES_JSON, milestones)
        except OSError as exc:
            self.note_write_error("milestones.json", exc)
            say(f"specdec: cannot record milestones: {exc.strerror or exc}")

    def write_restarts(self, **extra: Any) -> None:
        if self.policy is None:
            return
        doc = {
            "run_id": self.run_id,
            "policy": self.policy.as_dict(),
            "attempt": self.attempt,
            "state": self.restart_state,
            "restarts": self.restarts,
            **extra,
        }
        try:  # a full disk loses this record only: the restarts still happen and output.log says so
            records.write_json_atomic(self.run_dir / records.RESTARTS_JSON, doc)
        except OSError as exc:
            self.note_write_error(records.RESTARTS_JSON, exc)
            say(f"specdec: cannot record the restarts: {exc.strerror or exc}")

    disk_error: str | None = None  # the wrapper's own first write that failed for a full disk

    def note_write_error(self, name: str, exc: OSError) -> None:
        if exc.errno == errno.ENOSPC and self.disk_error is None:
            self.disk_error = f"the wrapper could not write {name}: {exc.strerror or exc}"

    def attempt_reason(self, scanner: records.RunScanner) -> str | None:
        """The ended attempt's own root cause: its words in its part of output.log or its engine events, and a full
        disk first (the run root's filesystem full now, or a write of the wrapper's that failed for it)."""
        own = records.root_cause(scanner.catch_up(), since=self.launch.attempt_started_at)
        full = disk.full_note(self.run_dir) or self.disk_error
        if full is None or (own is not None and "No space left on device" in own):
            return own
        return f"disk full: {full}: No space left on device" + (f" (then {own})" if own else "")

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
        signal.signal(CANCEL_SIGNAL, self.on_cancel)
        try:
            out_size = os.fstat(1).st_size
        except OSError:
            out_size = 0
        self.echo_offset = out_size
        now = time.time()
        self.launch = LaunchRecord(
            run_id=self.run_id,
            command=self.command,
            cwd=self.cwd,
            pid=os.getpid(),
            pgid=os.getpgid(0),
            wrapper_pid=os.getpid(),
            wrapper_start_ticks=procs.start_ticks_of(os.getpid()),
            boot_id=procs.read_boot_id(),
            hostname=socket.gethostname(),
            started_at=now,
            tmux_session=self.doc.get("tmux_session"),
            attachable=bool(self.doc.get("attachable")),
            step_pattern=self.step_pattern,
            deadlines_s=self.spec.get("deadlines_s") or {},
            profile=self.spec.get("profile"),
            spec=self.spec,
            output_offset_at_start=out_size,
            python=sys.executable,
            cancel_signal=records.signal_name(CANCEL_SIGNAL),  # `stop` sends it first: a stop is coming
        )
        self.write_launch()
        if not records.reserve_exit_record(self.run_dir):
            say("specdec: no room to reserve the exit record; it is written only if room is left")
        if not self.command:
            return self.fail_before_start(2, "the launch spec has an empty command")
        if self.spec.get("restart") is not None:
            try:
                self.policy = protocol.parse_policy(self.spec["restart"])
            except protocol.PolicyError as exc:
                return self.fail_before_start(2, f"the launch spec's restart policy is not usable: {exc}")
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
        site = stack_hook.prepare(self.run_dir, env)  # every Python process of the job dumps its stacks on SIGUSR1
        self.env = stack_hook.with_hook(env, site) if site is not None else env
        return self.attempts(out_size)

    def start_job(self) -> subprocess.Popen[bytes] | tuple[int, str]:
        """Start one attempt of the job; (exit code, the reason as a sentence) when it cannot be started."""
        self.attempt += 1
        env = dict(self.env)
        env[protocol.ENV_ATTEMPT] = str(self.attempt)
        try:
            job = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                env=env,
                close_fds=True,
                start_new_session=True,  # its own session and process group: stop signals exactly the job
            )
        except OSError as exc:
            return 127 if exc.errno == errno.ENOENT else 126, f"cannot run {self.command[0]!r}: {exc.strerror or exc}"
        self.job = job
        now = time.time()
        self.launch.attempt, self.launch.attempt_started_at = self.attempt, now
        if self.attempt == 1:
            self.launch.job_started_at = now  # the `started` milestone: the run's job first existed
        self.launch.job_pid, self.launch.job_pgid = job.pid, job.pid
        self.launch.job_start_ticks = procs.start_ticks_of(job.pid)
        self.write_launch()
        return job

    def attempts(self, out_base: int) -> int:
        """Run the job; under a restart policy, again after each ending the policy restarts, at most `max` times."""
        while True:
            started = self.start_job()
            if isinstance(started, tuple):
                code, why = started
                if self.attempt == 1:
                    return self.fail_before_start(code, why)
                self.restart_state = "gave_up"
                self.write_restarts()
                return self.finish(code, None, f"restart {self.attempt - 1} could not start the job: {why}")
            if self.attempt == 1:
                self.write_restarts()
            for pending_sig in self.pending:  # arrived between the check and Popen
                self.forward(pending_sig)
            self.pending.clear()
            ending = self.supervise(started, out_base)
            if self.policy is None:
                return self.finish_attempt(ending, ending.detail)
            cause = restart.restart_cause(ending, self.policy)
            why_not = self.cancelled()
            if cause is None or why_not is not None:
                cancels = cause is not None or ending.stopped is not None  # a stopped attempt is never restarted
                self.restart_state = "cancelled" if why_not is not None and cancels else "done"
                self.write_restarts()
                return self.finish_attempt(ending, self._ending_text(ending))
            assert self.launch.job_pgid is not None  # the job started: its group was recorded
            self.clear_leftovers(self.launch.job_pgid, self.launch.job_start_ticks)
            if len(self.restarts) >= self.policy.max:
                self.restart_state = "gave_up"
                self.write_restarts()
                said = restart.attempts_said(self.restarts)
                last = f"{ending.reason}; " if ending.reason else ""
                say(f"[specdec] ──── {self._ending_text(ending)}: gave up after {len(self.restarts)} restarts ────")
                return self.finish(
                    ending.exit_code,
                    ending.signal,
                    f"gave up after {len(self.restarts)} restart{'s' if len(self.restarts) != 1 else ''} "
                    f"({said}): the last attempt ({self.attempt}) {last}{self._ending_text(ending)}",
                    ending.reason,
                )
            entry = self.record_restart(cause, ending)
            if not self.backoff():
                why = self.cancelled() or "stop"
                self.restart_state = "cancelled"
                self.write_restarts()
                say(f"[specdec] ──── restart {len(self.restarts)} cancelled ({why}) during the backoff ────")
                return self.finish(
                    ending.exit_code,
                    ending.signal,
                    f"restart cancelled ({why}) during the backoff after attempt {self.attempt}, which "
                    f"{self._ending_text(ending)}",
                    ending.reason,
                )
            if cause == "oom":
                self.env, said = restart.with_expandable_segments(self.env)
                entry["env"] = {restart.ALLOC_CONF_ENV: self.env.get(restart.ALLOC_CONF_ENV)}
                entry["note"] = said
                say(f"[specdec] restart {len(self.restarts)} after a CUDA OOM: {said}")
            say(
                f"[specdec] ──── attempt {self.attempt + 1} of run {self.run_id}: restart {len(self.restarts)}/"
                f"{self.policy.max} after {cause} ────"
            )
            out_base = _size_of(self.run_dir / records.OUTPUT_LOG)
            self.restart_state = "watching"
            self.next_restart = entry  # supervise() adds the new attempt's start and first output to it

    def _ending_text(self, ending: restart.Ending) -> str:
        if ending.hang is not None:
            return f"hung ({ending.hang}), stopped: {ending.detail}"
        if ending.oom is not None and not ending.ok:
            return f"{ending.detail} (CUDA out of memory: {ending.oom})"
        return ending.detail

    def record_restart(self, cause: str, ending: restart.Ending) -> dict[str, Any]:
        assert self.policy is not None
        entry: dict[str, Any] = {
            "attempt": self.attempt,  # the attempt that ended; the restart starts attempt + 1
            "cause": cause,
            "at": ending.ended_at,
            "exit_code": ending.exit_code,
            "signal": ending.signal,
            "detail": self._ending_text(ending),
            "reason": ending.reason,  # the attempt's own root cause, in its words
            "backoff_s": self.policy.backoff_s,
        }
        if ending.stacks is not None:
            entry["stacks"] = ending.stacks
        self.restarts.append(entry)
        self.restart_state = "backoff"
        self.write_restarts(restart_at=time.time() + self.policy.backoff_s)
        say(
            f"[specdec] ──── attempt {self.attempt} {entry['detail']}: {cause}; restart {len(self.restarts)}/"
            f"{self.policy.max} in {self.policy.backoff_s:g} s ────"
        )
        return entry

    def backoff(self) -> bool:
        """Wait the policy's backoff; False as soon as a stop (or a signal) cancels the restart."""
        assert self.policy is not None
        deadline = time.monotonic() + self.policy.backoff_s
        while self.cancelled() is None:
            self.echo_offset = self.echo(self.echo_offset)
            left = deadline - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(POLL_S, left))
        return False

    def clear_leftovers(self, pgid: int, start_ticks: int | None) -> None:
        """End what is left of the ended attempt's process group (workers of a dead launcher) before the next one:
        they would hold its GPU memory. SIGTERM, the policy's grace, SIGKILL."""
        assert self.policy is not None
        left = procs.group_members(pgid, None, start_ticks)
        if not left:
            return
        # Pinned now (pid and start ticks): the group is signalled only while one of these still lives in it.
        pinned = {pid: ticks for pid in left if (ticks := procs.start_ticks_of(pid)) is not None}
        say(f"[specdec] {len(left)} process(es) of the ended attempt's group remain: SIGTERM to group {pgid}")
        signal_group_checked(pgid, pinned, signal.SIGTERM)
        deadline = time.monotonic() + self.policy.grace_s
        while procs.group_members(pgid, None, start_ticks) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if procs.group_members(pgid, None, start_ticks):
            say(f"[specdec] still there after the {self.policy.grace_s:g} s grace: SIGKILL to group {pgid}")
            signal_group_checked(pgid, pinned, signal.SIGKILL)
            deadline = time.monotonic() + KILL_WAIT_S
            while procs.group_members(pgid, None, start_ticks) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            stuck = procs.group_members(pgid, None, start_ticks)
            if stuck:  # uninterruptible sleep in the driver: the next attempt may find its GPU memory still held
                say(f"[specdec] pid(s) {', '.join(map(str, stuck))} still there {KILL_WAIT_S:g} s after SIGKILL")

    def finish_attempt(self, ending: restart.Ending, cause: str) -> int:
        """The end of the run with its last attempt: a stopped one says so, not "exited with code 1"."""
        if ending.stopped is not None:
            return self.finish(ending.exit_code, ending.signal, ending.stopped, stopped=True)
        return self.finish(ending.exit_code, ending.signal, cause, ending.reason)

    def finish(
        self, exit_code: int | None, sig: int | None, cause: str, root: str | None = None, stopped: bool = False
    ) -> int:
        self.write_exit(exit_code, sig, cause, root, stopped)
        self.echo_offset = self.echo(self.echo_offset)
        after = f" (after {len(self.restarts)} restarts: {restart.summary(self.restarts)})" if self.restarts else ""
        self.echo_status(f"[specdec] run {self.run_id} {cause}{after}")
        return 128 + sig if sig is not None else int(exit_code or 0)

    def supervise(self, job: subprocess.Popen[bytes], out_base: int) -> restart.Ending:
        """Watch one attempt until its job ends (or, under a hang policy, until it is stopped as hung)."""
        milestones = self.milestones
        scanner = records.RunScanner(self.run_dir, self.step_pattern, out_base)
        entry, self.next_restart = self.next_restart, None
        if entry is not None:
            entry["restarted_at"] = self.launch.attempt_started_at
            entry["pid"] = job.pid
            self.write_restarts()
        watch: restart.ProgressWatch | None = None
        if self.policy is not None and self.policy.watches_hangs:
            watch = restart.ProgressWatch(
                self.run_dir / records.OUTPUT_LOG,
                self.run_dir / records.EVENTS_JSONL,
                self.step_pattern,
                float(self.launch.attempt_started_at or 0.0),
                self.policy.stall_s,
                _deadline(self.spec, "first-step"),
            )
        status: int | None = None
        hang: str | None = None
        stacks_path: str | None = None
        while status is None:
            status = self._reap(job.pid)
            if status is not None:
                break
            now = time.time()
            if len(milestones) < 2 or entry is not None:
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
                if entry is not None and st.output_seen_at is not None:
                    entry["first_output_at"] = st.output_seen_at  # the restart's timing: exit -> new output
                    self.write_restarts()
                    entry = None
            self.echo_offset = self.echo(self.echo_offset)
            if watch is not None:
                watch.poll(now)
                hang = watch.hung(now)
                if hang is not None and self.cancelled() is None:
                    say(f"[specdec] attempt {self.attempt} hung: {hang}; dumping its stacks, then stopping it")
                    stacks_path = self.dump_stacks()
                    status = self.stop_hung(job)
                    break
                hang = None
            if len(milestones) == 2 and entry is None and self.pane_fd is None and watch is None:
                status = self._reap(job.pid, block=True)  # nothing left to watch: block until the job ends
                break
            self.nap(job.pid, POLL_S if len(milestones) < 2 or entry is not None else ECHO_POLL_S)
        assert status is not None
        ended_at = time.time()
        if entry is not None:  # it printed and ended within one poll: this poll's time bounds its first output
            st = scanner.poll()
            if st.output_seen_at is not None:
                entry["first_output_at"] = st.output_seen_at
                self.write_restarts()
        job.returncode = os.waitstatus_to_exitcode(status)
        self._final_milestones(scanner, milestones)  # before exit.json: a reader that sees the end sees these
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            ending = restart.Ending(None, sig, f"killed by signal {sig} ({records.signal_name(sig)})")
        else:
            code = os.WEXITSTATUS(status)
            ending = restart.Ending(code, None, f"exited with code {code}")
        ending.hang = hang
        ending.stacks = stacks_path
        ending.ended_at = ended_at
        asked = self.stop_request()
        if asked is not None and hang is None:
            ending.stopped = records.stopped_cause(scanner.catch_up(), ending.exit_code, ending.signal, asked[1])
        if not ending.ok and hang is None and ending.stopped is None:
            ending.oom = restart.find_oom(self.run_dir / records.OUTPUT_LOG, out_base)
        if not ending.ok and ending.stopped is None:
            ending.reason = f"hung ({ending.hang})" if ending.hang is not None else self.attempt_reason(scanner)
        self.echo_offset = self.echo(self.echo_offset)
        return ending

    def nap(self, pid: int, timeout_s: float) -> None:
        """Sleep up to timeout_s, waking the moment the job exits (a pidfd, Linux >= 5.3; else a plain sleep)."""
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            time.sleep(timeout_s)
            return
        try:
            select.select([fd], [], [], timeout_s)
        finally:
            os.close(fd)

    def dump_stacks(self) -> str:
        """Every thread's stack of the hung attempt, into stacks/hang-attempt-N.txt: the path, or why there is none."""
        rel = f"{stackdump.STACKS_DIR}/hang-attempt-{self.attempt}.txt"
        try:
            res = stacks.stacks(self.run_dir, timeout_s=HANG_DUMP_TIMEOUT_S, boot_id=self.launch.boot_id)
        except (SupervisorError, OSError, subprocess.SubprocessError) as exc:
            # A rank exiting mid-dump or py-spy timing out: the hang is still handled (stop, restart) without stacks.
            say(f"[specdec] no stack dump: {type(exc).__name__}: {exc}")
            return f"no stack dump: {exc}"
        try:
            (self.run_dir / stackdump.STACKS_DIR).mkdir(exist_ok=True)
            (self.run_dir / rel).write_text(f"# {res['method']}\n{res['text']}", encoding="utf-8")
        except OSError as exc:
            say(f"[specdec] the stack dump could not be saved: {exc}")
            return f"stack dump not saved: {exc}"
        say(f"[specdec] stacks in {rel} ({res['method']})")
        return rel

    def stop_hung(self, job: subprocess.Popen[bytes]) -> int:
        """SIGTERM to the hung job's group, the policy's grace, then SIGKILL; the job's wait status."""
        assert self.policy is not None
        say(f"[specdec] SIGTERM to process group {job.pid} ({self.policy.grace_s:g} s grace, then SIGKILL)")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.policy.grace_s
        while time.monotonic() < deadline:
            status = self._reap(job.pid)
            if status is not None:
                return status
            self.echo_offset = self.echo(self.echo_offset)
            time.sleep(POLL_S)
        status = self._reap(job.pid)
        if status is not None:
            return status
        say(f"[specdec] still running after the {self.policy.grace_s:g} s grace: SIGKILL to process group {job.pid}")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        blocked = self._reap(job.pid, block=True)
        assert blocked is not None
        return blocked

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


def _size_of(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _deadline(spec: dict[str, Any], milestone: str) -> float | None:
    value = (spec.get("deadlines_s") or {}).get(milestone)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specdec-wrapper", description="run one job under supervision", allow_abbrev=False
    )
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
        records.write_exit_record(
            run_dir, ExitRecord(exit_code=2, ended_at=time.time(), cause=f"unreadable launch spec: {exc}")
        )
        return 2
    return Wrapper(run_dir, doc, pane_fd).run()


if __name__ == "__main__":
    sys.exit(main())
