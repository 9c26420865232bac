"""Start ``specdec-train serve-check`` for a supervised run from the dashboard (key ``v``) or the agent.

The check serves the newest checkpoint the run's events name (its export, made on the way when missing) with the
run's target through vLLM, on the held-out prompts, and appends its result to the run's events.jsonl as a
``served`` event, which the dashboard shows beside the trained τ. It runs detached (its own session), so it
outlives the agent and the link; one at a time per run (``serve_check.pid`` in the run directory names it), its
output in ``serve_check.log``. vLLM's interpreter: the request's ``vllm_python``, else ``$SPECDEC_VLLM_PYTHON``
on the host, else the agent's own; without vLLM the check ends at once with a ``served`` event that says so.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import engine
from engine import protocol
from engine.host import procs
from engine.host.files import NotRegularFileError, open_regular
from engine.supervisor import records
from engine.supervisor.common import SupervisorError
from engine.supervisor.records.layout import EVENTS_JSONL

CHECK_LOG = "serve_check.log"
CHECK_PID = "serve_check.pid"
CHECK_LOCK = "serve_check.lock"
ENV_VLLM_PYTHON = "SPECDEC_VLLM_PYTHON"
TAIL_CHUNK = 1 << 20
TAIL_MAX_BYTES = 32 << 20  # how far back from the end of events.jsonl a checkpoint is looked for
LOCK_WAIT_S = 5.0  # the lock is held for the moment a start takes: longer means another process keeps it
LOCK_POLL_S = 0.05


def latest_checkpoint(events: Path, max_bytes: int = TAIL_MAX_BYTES) -> Path | None:
    """The newest checkpoint a run's events name (a ``checkpoint`` event, or the source of an ``export``), read
    backwards from the end in 1 MiB chunks, at most ``max_bytes``: a huge events file costs no more than that."""
    try:
        fh = events.open("rb")
    except OSError:
        return None
    with fh:
        end = fh.seek(0, os.SEEK_END)
        pos, carry = end, b""
        while pos > 0 and end - pos < max_bytes:
            step = min(TAIL_CHUNK, pos)
            pos -= step
            fh.seek(pos)
            block = fh.read(step) + carry
            lines = block.split(b"\n")
            carry = lines[0] if pos > 0 else b""  # the first line may start in the chunk before
            for line in reversed(lines[1:] if pos > 0 else lines):
                if b'"checkpoint"' not in line:
                    continue
                event = protocol.decode_engine_line(line)
                if isinstance(event, protocol.CheckpointEvent):
                    return Path(event.path)
                if isinstance(event, protocol.ExportEvent) and event.checkpoint:
                    return Path(event.checkpoint)
    return None


def running_check(run_dir: Path) -> int | None:
    """The pid of this run's serve-check while it runs, else None. The pid file must name that very process: this
    boot, the same start time (a reused pid is not it) and the argv the check was started with (a stale or foreign
    file naming another live process is not it either)."""
    record = records.read_json(run_dir / CHECK_PID)  # a regular file only, bounded: a FIFO is no record
    if record is None:
        return None
    pid, ticks, boot, argv = (record.get(k) for k in ("pid", "start_ticks", "boot_id", "argv"))
    if not (isinstance(pid, int) and isinstance(ticks, int) and isinstance(argv, list) and argv):
        return None
    if boot != procs.read_boot_id() or not procs.process_alive(pid, ticks):
        return None
    return pid if procs.argv_of(pid) == argv else None


def _open_regular(path: Path, flags: int) -> int:
    """``path`` opened without blocking and without following a link; SupervisorError unless a regular file."""
    try:
        return open_regular(path, flags)
    except NotRegularFileError:
        raise SupervisorError(
            f"{path.name} in the run directory is not a regular file (remove it); not started"
        ) from None
    except OSError as exc:  # ENXIO: a FIFO nobody reads; ELOOP: a link
        raise SupervisorError(
            f"{path.name} in the run directory cannot be opened: {exc.strerror}; not started"
        ) from None


def _lock(fd: int, path: Path, wait_s: float) -> None:
    """Take ``fd``'s exclusive lock, waiting at most ``wait_s``: SupervisorError when another process holds it."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise SupervisorError(
                    f"{path.name} is held by another process for over {wait_s:g} s (another serve-check starting "
                    "for this run?); not started"
                ) from None
            time.sleep(LOCK_POLL_S)


def start(run_dir: Path, vllm_python: str | None = None, *, run_live: bool = False) -> dict[str, object]:
    """Start the check for ``run_dir``'s newest checkpoint; returns pid, checkpoint, log and the vLLM interpreter.
    Raises SupervisorError (a sentence for the user) when one runs already, the run has no checkpoint yet, or the
    run is live and ``run_live`` was not said: vLLM takes most of a GPU's memory for itself and would load the
    target beside the training, which can run out of memory. One agent at a time decides (a lock in the run dir,
    waited for at most LOCK_WAIT_S); a lock or log that is not a regular file is refused, never waited on."""
    lock_path = run_dir / CHECK_LOCK
    fd = _open_regular(lock_path, os.O_RDWR | os.O_CREAT)
    try:
        _lock(fd, lock_path, LOCK_WAIT_S)  # two presses of v, or two dashboards: one check
        return _start_locked(run_dir, vllm_python, run_live)
    finally:
        os.close(fd)


def _start_locked(run_dir: Path, vllm_python: str | None, run_live: bool) -> dict[str, object]:
    busy = running_check(run_dir)
    if busy is not None:
        raise SupervisorError(f"a serve-check of this run is running already (pid {busy}; {run_dir / CHECK_LOG})")
    launch = records.read_launch(run_dir)
    # the job is what holds the GPUs (its wrapper outlives it by a moment, writing the exit record)
    live = launch is not None and (launch.job_alive() or (launch.job_pid is None and launch.wrapper_alive()))
    if not run_live and live:
        raise SupervisorError(
            "the run is live: vLLM would load its target beside the training on the same GPUs (it takes most of a "
            "GPU's memory); check after the run, or say so (the dashboard asks)"
        )
    events = run_dir / EVENTS_JSONL
    checkpoint = latest_checkpoint(events)
    if checkpoint is None:
        raise SupervisorError("no checkpoint in this run's events yet: serve-check serves a checkpoint's export")
    python = vllm_python or os.environ.get(ENV_VLLM_PYTHON) or sys.executable
    if "\0" in python or not python.strip():
        raise SupervisorError("vllm_python: not a path")
    engine_root = str(Path(engine.__file__).resolve().parent.parent)
    inherited = os.environ.get("PYTHONPATH")
    env = {**os.environ, protocol.ENV_EVENTS_PATH: str(events)}
    env["PYTHONPATH"] = engine_root + (os.pathsep + inherited if inherited else "")
    # "--" first: the checkpoint's path comes from the job's own events and must never read as an option
    argv = [sys.executable, "-m", "engine.trainer", "serve-check", "--vllm-python", python, "--", str(checkpoint)]
    log_path = run_dir / CHECK_LOG
    log = _open_regular(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # a FIFO would block the open
    try:
        # cwd: the engine's own tree, since ``-m`` puts the working directory first on sys.path (not the run dir)
        child = subprocess.Popen(
            argv, cwd=engine_root, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )  # fmt: skip
    finally:
        os.close(log)
    threading.Thread(target=child.wait, name="serve-check-reaper", daemon=True).start()
    ticks = procs.start_ticks_of(child.pid)
    record = {
        "pid": child.pid,
        "start_ticks": ticks,
        "boot_id": procs.read_boot_id(),
        "argv": argv,  # what running_check compares /proc/<pid>/cmdline with
        "checkpoint": str(checkpoint),
    }
    records.write_json_atomic(run_dir / CHECK_PID, record)
    return {"pid": child.pid, "checkpoint": str(checkpoint), "log": str(log_path), "vllm_python": python}
