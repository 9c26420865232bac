"""The ``launch`` verb: validate a LaunchSpec, claim a run directory, start the wrapper under tmux (or setsid).

Every reason not to start is an error with a sentence, never a silent non-start.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import engine
from engine import protocol
from engine.host import procs
from engine.supervisor import records, tmux
from engine.supervisor.common import BadRequest, SupervisorError
from engine.supervisor.records import SubmittedRecord


def coerce_spec(raw: protocol.LaunchSpec | dict[str, Any]) -> protocol.LaunchSpec:
    """A validated LaunchSpec from the wire (unknown keys refused, types checked)."""
    if isinstance(raw, protocol.LaunchSpec):
        data = asdict(raw)
    elif isinstance(raw, dict):
        data = dict(raw)
    else:
        raise BadRequest("launch needs an object of LaunchSpec fields")
    known = set(protocol.LaunchSpec.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise BadRequest(f"unknown launch fields {unknown}; known: {sorted(known)}")
    command = data.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise BadRequest("launch needs a command: a non-empty list of strings (argv, never a shell line)")
    if not command[0]:
        raise BadRequest("the command's first word is empty")
    env = data.get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise BadRequest("env must map strings to strings")
    if any(not k or "=" in k or "\0" in k for k in env):
        raise BadRequest("env names must be non-empty and contain neither '=' nor NUL")
    deadlines = data.get("deadlines_s") or {}
    if not isinstance(deadlines, dict):
        raise BadRequest("deadlines_s must map milestones to seconds")
    for name, value in deadlines.items():
        if name not in protocol.MILESTONES:
            raise BadRequest(f"unknown milestone {name!r} in deadlines_s; milestones: {list(protocol.MILESTONES)}")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise BadRequest(f"deadline for {name!r} must be a positive number of seconds")
    pattern = data.get("step_pattern") or r"step=\d+"
    try:
        re.compile(pattern.encode())
    except (re.error, AttributeError) as exc:
        raise BadRequest(f"step_pattern {pattern!r} is not a valid regular expression: {exc}") from exc
    run_id = data.get("run_id")
    if run_id is not None:
        try:
            protocol.validate_run_id(run_id)
        except protocol.RunIdError as exc:
            raise BadRequest(str(exc)) from exc
    cwd = data.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise BadRequest("cwd must be a string")
    profile = data.get("profile")
    policy: dict[str, Any] | None = None
    if data.get("restart") is not None:
        try:
            policy = protocol.parse_policy(data["restart"]).as_dict()
        except protocol.PolicyError as exc:
            raise BadRequest(f"launch field {exc}") from exc
    return protocol.LaunchSpec(
        command=list(command),
        cwd=cwd,
        env=dict(env),
        run_id=run_id,
        step_pattern=pattern,
        deadlines_s={k: float(v) for k, v in deadlines.items()},
        profile=profile if isinstance(profile, str) else None,
        restart=policy,
    )


def check_run_root(run_root: Path) -> Path:
    """Create <run_root>/runs and prove we can write there (os.access lies for root on read-only mounts)."""
    runs = records.runs_dir(run_root)
    try:
        runs.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", dir=runs)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        where = f" ({exc.filename})" if exc.filename else ""
        raise SupervisorError(f"run root {run_root} is not writable: {reason}{where}") from exc
    return runs


def _engine_root() -> str:
    # The directory holding the `engine` package: the wrapper is started from there with `python3 -m`.
    return str(Path(engine.__file__).resolve().parent.parent)


def _reap_in_background(proc: subprocess.Popen[bytes]) -> None:
    threading.Thread(target=proc.wait, name=f"reap-{proc.pid}", daemon=True).start()


def _claim_run_id(root: Path, wanted: str | None, use_tmux: bool) -> tuple[str, Path, str | None]:
    """Create the run directory for a free run id (and tmux session name); a generated id is redrawn on a clash."""
    for _ in range(5 if wanted is None else 1):
        run_id = wanted or records.new_run_id()
        run_dir = records.run_dir_for(root, run_id)
        session = tmux.session_name(run_id) if use_tmux else None
        if session is not None and tmux.has_session(session):
            if wanted is None:
                continue
            raise BadRequest(
                f"tmux session {session!r} already exists (run id {run_id!r} clashes with it); pick another run id, "
                f"or end that session with: {shlex.join(tmux.base_argv())} kill-session -t ={session}"
            )
        try:
            run_dir.mkdir()
        except FileExistsError as exc:
            if wanted is None:
                continue
            raise BadRequest(f"run {run_id!r} already exists at {run_dir}; pick another run id") from exc
        except OSError as exc:
            raise SupervisorError(f"cannot create run directory {run_dir}: {exc.strerror or exc}") from exc
        return run_id, run_dir, session
    raise SupervisorError("could not find a free run id after 5 tries; pass one with run_id")


def close_finished_sessions(root: Path) -> list[str]:
    """Closes the tmux sessions of this run root's earlier runs whose end is recorded (exit.json) and whose pane is
    dead: remain-on-exit keeps each run's last screen to read until the next launch, so sessions do not pile up
    (one a launch, before). Only sessions named in our own run records; a pane still alive, or a run whose wrapper
    died before it recorded the end (its pane tells why), is left alone. Returns the sessions closed."""
    dead = tmux.dead_sessions()
    closed: list[str] = []
    for run_dir in records.list_runs(root) if dead else []:
        sub = records.read_submitted(run_dir)
        name = sub.tmux_session if sub is not None else None
        if name in dead and records.read_exit(run_dir) is not None and tmux.kill_session(name):
            closed.append(name)
    return closed


def launch(spec_in: protocol.LaunchSpec | dict[str, Any], run_root: Path | str) -> dict[str, Any]:
    """Start the wrapper for a run; returns once tmux (or setsid) accepted it (the `submitted` milestone).

    Every reason not to start is an error with a sentence, never a silent non-start.
    """
    spec = coerce_spec(spec_in)
    root = Path(run_root).expanduser()
    check_run_root(root)
    cwd = os.path.expanduser(spec.cwd) if spec.cwd else os.path.expanduser("~")
    if not os.path.isabs(cwd):
        raise BadRequest(f"working directory {cwd!r} must be an absolute path on the host")
    if not os.path.isdir(cwd):
        what = "is not a directory" if os.path.exists(cwd) else "does not exist"
        raise BadRequest(f"working directory {cwd} {what} on the host")
    spec.cwd = cwd
    use_tmux = tmux.available()
    if use_tmux:
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):  # tidying only: never what stops a launch
            close_finished_sessions(root)
    run_id, run_dir, session = _claim_run_id(root, spec.run_id, use_tmux)
    spec.run_id = run_id
    doc = {"spec": asdict(spec), "run_id": run_id, "tmux_session": session, "attachable": use_tmux}
    spec_path = run_dir / records.SPEC_JSON
    records.write_json_atomic(spec_path, doc, mode=0o600)
    argv = [
        sys.executable,
        "-m",
        "engine.supervisor.wrapper",
        "--run-dir",
        str(run_dir),
        "--spec-json",
        str(spec_path),
    ]
    note = None if session is not None else "tmux is not available on the host: started with setsid; not attachable"
    sub_doc = SubmittedRecord(
        t=time.time(),
        phase="submitting",  # "accepted" once tmux (or setsid) took the wrapper
        run_id=run_id,
        tmux_session=session,
        attachable=session is not None,
        tmux_socket=os.environ.get(tmux.SOCKET_ENV),
        launcher_pid=os.getpid(),
        launcher_start_ticks=procs.start_ticks_of(os.getpid()),
        spec=asdict(spec),
        note=note,
    )
    # The run is visible (submitted.json, current) before its job can exist: whatever ends this process from here
    # on, `status` shows the run, starting, then running or why it never started.
    previous = _current_link(root)
    try:
        records.write_json_atomic(run_dir / records.SUBMITTED_JSON, sub_doc.to_json(), mode=0o600)
        records.set_current(root, run_dir)
    except OSError as exc:
        shutil.rmtree(run_dir, ignore_errors=True)
        _restore_current(root, previous)
        raise SupervisorError(f"could not record run {run_id} in {run_dir}: {exc.strerror or exc}") from exc
    wrapper_pid: int | None = None
    wrapper_ticks: int | None = None
    try:
        if session is not None:
            shell = f"cd {shlex.quote(_engine_root())} && exec {shlex.join([*argv, '--echo-to-pane'])}"
            tmux.new_session(session, shell)  # the wrapper enters the job's cwd itself (spec.cwd)
        else:
            proc = subprocess.Popen(
                argv,
                cwd=_engine_root(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                start_new_session=True,  # no controlling terminal: a closing SSH or pct channel cannot reach it
            )
            wrapper_pid = proc.pid
            wrapper_ticks = procs.start_ticks_of(proc.pid)
            _reap_in_background(proc)
    except (tmux.TmuxError, OSError, subprocess.SubprocessError) as exc:
        # Nothing started: leave no husk of a run that never was, and the previous run current again.
        _restore_current(root, previous)
        shutil.rmtree(run_dir, ignore_errors=True)
        raise SupervisorError(f"could not start run {run_id}: {exc}") from exc
    submitted_at = time.time()
    sub_doc.t, sub_doc.phase = submitted_at, "accepted"
    sub_doc.launcher_wrapper_pid, sub_doc.launcher_wrapper_start_ticks = wrapper_pid, wrapper_ticks
    with contextlib.suppress(OSError):  # the run is recorded already; a full disk here only loses the wrapper pid
        records.write_json_atomic(run_dir / records.SUBMITTED_JSON, sub_doc.to_json(), mode=0o600)
    return {
        "run_id": run_id,
        "run_dir": str(run_dir),
        "tmux_session": session,
        "attachable": session is not None,
        "attach": tmux.attach_command(session) if session is not None else None,
        "submitted_at": submitted_at,
        "note": note,
    }


def _current_link(root: Path) -> str | None:
    try:
        return os.readlink(root / records.CURRENT_LINK)
    except OSError:
        return None


def _restore_current(root: Path, previous: str | None) -> None:
    """Point <run_root>/current back where it pointed before a launch that did not happen."""
    with contextlib.suppress(OSError):
        if previous is None:
            (root / records.CURRENT_LINK).unlink(missing_ok=True)
        else:
            records.set_current(root, Path(previous) if os.path.isabs(previous) else root / previous)


def spec_of(run_dir: Path | str) -> dict[str, Any]:
    """The LaunchSpec a run was started with (for restart)."""
    rd = Path(run_dir)
    for name in (records.LAUNCH_JSON, records.SUBMITTED_JSON, records.SPEC_JSON):
        doc = records.read_json(rd / name)
        if doc is not None and isinstance(doc.get("spec"), dict):
            return dict(doc["spec"])
    raise SupervisorError(f"run {rd.name} has no recorded launch spec")
