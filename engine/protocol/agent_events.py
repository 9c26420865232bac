"""Agent events: every line the agent sends (``{"ev": <kind>, ...}``) as a dataclass, and back.

A client decodes each event once, where the line arrives (``decode_event`` of a ``parse_event`` object); the
agent writes a typed one with ``event_to_wire``. The wire stays the JSON objects below, read by the rules of
engine/protocol/typed_json.py (unknown keys ignored, a missing or mistyped field a ProtocolError naming it).
An ``engine`` line carries one engine event (engine/protocol/engine_events.py), chosen by its ``kind``.

Events (``ev``)
---------------
hello       protocol, agent_version, hostname, boot_id, python, pid, run_root, simulated,
            capabilities: {name: {"ok": bool, "detail": str}}   (nvml, psutil, watchfiles, tmux, py_spy)
gpus        t, simulated, gpus: [GpuInfo], nvml_error (str | None)
procs       t, run_tree: [ProcInfo], holders: [HolderInfo]
            (+ holders_source: {"source": one of GPUS_SOURCES | "fd-scan", "detail"}, host_map: the --pct host view's
               {"state": "ok" | "stale" | "unavailable", "detail", "ctid", ...} | None; ``status`` carries both too)
log         offset, inode, data                 data starts at byte ``offset`` of the file
log_reset   inode, offset, reason               "created" | "rotated" | "truncated"; following restarts at offset
            (+ run_id: the run whose output.log this is; "created" also marks a switch to a new current run)
engine      offset, event: EngineEvent          one line of the run's events.jsonl; offset = byte after it
            (+ inode, run_id of that events.jsonl, for resuming)
run         run: RunInfo | None                 sent whenever the run state changes
anomalies   items: [Anomaly]                    the complete current list (replaces the previous one)
milestone   run_id, milestone, t, ok, cause     a launch milestone reached or failed
progress    id, message                         progress of a long command (stop, kill_stale) before its reply
reply       id, ok, result, error               the answer to a command
            (+ error_kind: "input" when the request itself was wrong, e.g. a launch's cwd that is not there)
warning     message                             something the user should see that is not an error of a command
error       message                             the agent itself hit a problem it cannot attach to a command
            (also: a malformed command line is answered with ``error``; the agent never dies of bad input)
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

from engine.protocol.engine_events import EngineEvent
from engine.protocol.payloads import Anomaly, GpuInfo, HolderInfo, HoldersSource, HostMapState, ProcInfo, RunInfo
from engine.protocol.typed_json import from_json
from engine.protocol.wire import ProtocolError, decode_log_data, to_jsonable


@dataclass
class HelloEvent:
    EV: ClassVar[str] = "hello"
    protocol: int
    agent_version: str = "?"
    hostname: str | None = None
    boot_id: str | None = None
    python: str | None = None  # its version
    python_path: str | None = None  # the agent's interpreter (sys.executable)
    pid: int | None = None
    run_root: str | None = None
    simulated: bool = False
    capabilities: dict[str, Any] = field(default_factory=dict)
    readonly: bool = False  # the agent refuses launch, stop, restart, kill_stale (to signal) and serve_check
    t: float | None = None  # the host's clock at hello: a client's engine events from before it are history


@dataclass
class GpusEvent:
    EV: ClassVar[str] = "gpus"
    t: float
    gpus: list[GpuInfo] = field(default_factory=list)
    simulated: bool = False
    source: str | None = None
    nvml_error: str | None = None


@dataclass
class ProcsEvent:
    EV: ClassVar[str] = "procs"
    t: float
    run_tree: list[ProcInfo] = field(default_factory=list)
    holders: list[HolderInfo] = field(default_factory=list)
    holders_source: HoldersSource | None = None
    host_map: HostMapState | None = None


@dataclass
class LogEvent:
    EV: ClassVar[str] = "log"
    offset: int  # the byte of output.log that ``data`` starts at
    inode: int
    data: str  # encode_log_data of the bytes

    @property
    def raw(self) -> bytes:
        return decode_log_data(self.data)


@dataclass
class LogResetEvent:
    EV: ClassVar[str] = "log_reset"
    inode: int
    offset: int
    reason: str = "reset"  # "created" | "rotated" | "truncated"
    run_id: str | None = None


@dataclass
class EngineLineEvent:
    """One line of a run's events file (``ev: "engine"``)."""

    EV: ClassVar[str] = "engine"
    event: EngineEvent
    offset: int | None = None  # the byte after the line in events.jsonl (None: another rank's file)
    inode: int | None = None
    run_id: str | None = None
    source: str | None = None  # another rank's events file (events.rank<R>.jsonl); None: the run's own


@dataclass
class RunEvent:
    EV: ClassVar[str] = "run"
    run: RunInfo | None


@dataclass
class AnomaliesEvent:
    EV: ClassVar[str] = "anomalies"
    items: list[Anomaly] = field(default_factory=list)
    t: float | None = None


@dataclass
class MilestoneEvent:
    EV: ClassVar[str] = "milestone"
    milestone: str
    ok: bool = True
    run_id: str | None = None
    t: float | None = None
    cause: str | None = None


@dataclass
class ProgressEvent:
    EV: ClassVar[str] = "progress"
    message: str
    id: int | None = None


@dataclass
class ReplyEvent:
    EV: ClassVar[str] = "reply"
    id: int | None
    ok: bool
    result: Any = None
    error: str | None = None
    error_kind: str | None = None  # ERROR_KIND_INPUT: the request itself was wrong (bad input), else None


@dataclass
class WarningEvent:
    EV: ClassVar[str] = "warning"
    message: str


@dataclass
class ErrorEvent:
    EV: ClassVar[str] = "error"
    message: str


Event = Union[  # noqa: UP007
    HelloEvent,
    GpusEvent,
    ProcsEvent,
    LogEvent,
    LogResetEvent,
    EngineLineEvent,
    RunEvent,
    AnomaliesEvent,
    MilestoneEvent,
    ProgressEvent,
    ReplyEvent,
    WarningEvent,
    ErrorEvent,
]
EVENT_TYPES: dict[str, type[Any]] = {cls.EV: cls for cls in typing.get_args(Event)}


def decode_event(obj: dict[str, Any]) -> Event:
    """A parsed event line (``parse_event``) as its dataclass; raises ProtocolError naming the bad field."""
    kind = obj.get("ev")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown event {kind!r}")
    decoded: Event = from_json(cls, obj, kind)
    return decoded


def event_to_wire(ev: Event) -> dict[str, Any]:
    """The JSON object of a typed event, as the agent sends it (``decode_event``'s inverse)."""
    wire: dict[str, Any] = {"ev": ev.EV, **to_jsonable(ev)}
    if isinstance(ev, EngineLineEvent):
        wire["event"] = {"kind": ev.event.KIND, **wire["event"]}
    return wire
