"""A run's three JSON records (submitted.json, launch.json, exit.json), typed, and which live processes are the run's.

The supervisor writes three JSON records per run directory; every reader goes through these dataclasses,
so a field is spelled once. ``from_json`` keeps a field only when its value has the declared type (a record
written by another version, or by hand, cannot put a string where a pid belongs) and keeps unknown keys in
``extra``; ``to_json`` writes the same keys back (fields in ``OMITTED_WHEN_NONE`` only once set).

``run_pids``: a process counts only while it is provably the one recorded: the wrapper and the job are
checked against their recorded start ticks, and members of the job's process group must have started no
earlier than the job (a group id reused after the run ended names someone else's processes).
"""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from engine import protocol
from engine.host import procs
from engine.supervisor.records.layout import EXIT_JSON, LAUNCH_JSON, SUBMITTED_JSON, read_json

R = TypeVar("R", bound="Record")


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    """A record class's field annotations (resolved once: get_type_hints costs most of a read)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in fields(cls) if f.name != "extra"}


class Record:
    """What the three run records share: typed reading, writing back the same keys, unknown keys kept."""

    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset()
    extra: dict[str, Any]

    @classmethod
    def from_json(cls: type[R], doc: dict[str, Any]) -> R:
        """Known keys whose values fit become fields; every other key (unknown, or of a type the field does not
        take) stays in ``extra``, so ``to_json`` writes the document back as it was read."""
        hints = _field_hints(cls)  # type: ignore[arg-type]  # a class is hashable
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in doc.items():
            if k not in hints:
                extra[k] = v
                continue
            try:
                kwargs[k] = protocol.decode_as(hints[k], v)  # the protocol's typed-JSON decoder, one field at a time
            except protocol.ProtocolError:
                extra[k] = v  # not of the field's type: kept as written, never put where a pid belongs
        kwargs["extra"] = extra
        return cls(**kwargs)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "extra" or (value is None and f.name in self.OMITTED_WHEN_NONE):
                continue
            out[f.name] = value
        out.update(self.extra)
        return out

    @classmethod
    def read(cls: type[R], path: Path | str) -> R | None:
        """The record in ``path``; None when missing, not a regular file or not (yet) a JSON object."""
        doc = read_json(path)
        return cls.from_json(doc) if doc is not None else None


@dataclass
class SubmittedRecord(Record):
    """submitted.json: written by the launcher, before the wrapper exists ("submitting"), then "accepted"."""

    t: float | None = None
    phase: str = "accepted"
    run_id: str | None = None
    tmux_session: str | None = None
    attachable: bool = False
    tmux_socket: str | None = None
    launcher_pid: int | None = None
    launcher_start_ticks: int | None = None
    launcher_wrapper_pid: int | None = None  # without tmux: the wrapper started with setsid
    launcher_wrapper_start_ticks: int | None = None
    spec: dict[str, Any] | None = None
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class LaunchRecord(Record):
    """launch.json: written by the wrapper when it starts, again with the job's ids once the job exists."""

    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset(
        {"job_pid", "job_pgid", "job_start_ticks", "job_started_at", "attempt", "attempt_started_at"}
    )

    run_id: str | None = None
    command: list[str] = field(default_factory=list)
    cwd: str | None = None
    pid: int | None = None
    pgid: int | None = None
    wrapper_pid: int | None = None
    wrapper_start_ticks: int | None = None
    boot_id: str | None = None
    hostname: str | None = None
    started_at: float | None = None
    tmux_session: str | None = None
    attachable: bool = False
    step_pattern: str | None = None
    deadlines_s: dict[str, float] = field(default_factory=dict)
    profile: str | None = None
    spec: dict[str, Any] | None = None
    output_offset_at_start: int = 0
    python: str | None = None
    cancel_signal: str | None = None  # `stop` sends it to the wrapper first: a stop is coming
    job_pid: int | None = None
    job_pgid: int | None = None
    job_start_ticks: int | None = None
    job_started_at: float | None = None  # the `started` milestone: the run's job first existed
    attempt: int | None = None
    attempt_started_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def job_alive(self) -> bool:
        return procs.process_alive(self.job_pid, self.job_start_ticks)

    def wrapper_alive(self) -> bool:
        return procs.process_alive(self.wrapper_pid, self.wrapper_start_ticks)


@dataclass
class ExitRecord(Record):
    """exit.json: how the job ended, written once by the wrapper (into reserved blocks when the disk is full)."""

    OMITTED_WHEN_NONE: ClassVar[frozenset[str]] = frozenset(
        {"attempts", "restarts", "restart_state", "stop_requested", "stopped"}
    )

    run_id: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    signal_name: str | None = None
    ended_at: float | None = None
    cause: str | None = None
    forwarded_signals: list[Any] = field(default_factory=list)
    attempts: int | None = None  # under a restart policy
    restarts: list[dict[str, Any]] | None = None
    restart_state: str | None = None
    stop_requested: str | None = None  # what asked the run to stop ("stop", "SIGTERM to the wrapper"), when asked
    stopped: bool | None = None  # True: it ended because it was stopped, cleanly (the state reads "stopped")
    extra: dict[str, Any] = field(default_factory=dict)


def run_pids(launch: LaunchRecord | None, table: dict[int, procs.ProcStat] | None = None) -> set[int]:
    """The wrapper, the job, their descendants and the job's process group, as far as each is still ours."""
    if launch is None:
        return set()
    stats = table if table is not None else procs.all_stats()
    out: set[int] = set()
    for pid, ticks in ((launch.wrapper_pid, launch.wrapper_start_ticks), (launch.job_pid, launch.job_start_ticks)):
        st = stats.get(pid) if pid is not None else None
        if st is None or (ticks is not None and st.start_ticks != ticks):
            continue
        out.update(procs.tree_pids(st.pid, stats))
    if launch.job_pgid is not None:
        out.update(procs.group_members(launch.job_pgid, stats, launch.job_start_ticks))
    return out


def read_launch(run_dir: Path | str) -> LaunchRecord | None:
    return LaunchRecord.read(Path(run_dir) / LAUNCH_JSON)


def read_exit(run_dir: Path | str) -> ExitRecord | None:
    return ExitRecord.read(Path(run_dir) / EXIT_JSON)


def read_submitted(run_dir: Path | str) -> SubmittedRecord | None:
    return SubmittedRecord.read(Path(run_dir) / SUBMITTED_JSON)
