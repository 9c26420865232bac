"""Replies: what a command carries and the typed ``result`` of each command's ``reply``.

A client decodes a reply's ``result`` once where it arrives (``from_json(cls, result, cmd)``), by the rules of
engine/protocol/typed_json.py: unknown keys ignored, a missing or mistyped field a ProtocolError naming it. The
reply stays on the wire as the agent sent it (``status --json`` prints that object). ``LaunchSpec`` is what
``launch`` carries, ``WaitResult`` what ``wait`` answers (``launch --wait --json`` prints it).

Commands (``cmd``)
------------------
ping        {}                                          -> {"t": float}
status      {}                                          -> StatusReply (its required keys: ``STATUS_KEYS``)
subscribe   {gpu_interval_s, procs_interval_s,          -> {}; then streams gpus/procs/anomalies/run events,
             log: {"offset", "inode"} | None,              log events from that position (None: from the start),
             engine_offset: int | None}                     engine events from that byte offset of events.jsonl
            (+ optional engine_inode, run_id: the run the offsets belong to; another run streams from 0;
               + optional stall: {k, floor_s, cap_s, heartbeat_timeout_s} for the stalled/dead-thread checks)
unsubscribe {}                                          -> {"stopped": bool}; ends the streams of subscribe
tail        {n, run_id?, stream?}                       -> {"lines": [str], "offset": int, "inode": int, "partial",
                                                            "run_id", "current"}; at most 10,000 lines; with
                                                            stream: no lines, "start" = where the last n begin
read_log    {run_id?, offset, max_bytes}                -> {"data", "offset", "inode", "size", "run_id"}
runs        {limit}                                     -> {"runs": [RunInfo + duration_s, current], "total"}
run_info    {run_id?}                                   -> {"run": RunInfo}   (run_id: default the current run)
launch      LaunchSpec fields                           -> {"run_id", "run_dir", "tmux_session", "attachable"}
            (+ restart: the restart policy the wrapper applies on the host, engine/supervisor/restart.py)
wait        {run_id, milestone, timeout_s}              -> WaitResult fields (``launch --json``)
stop        {grace_s, release_timeout_s}                -> {"stopped", "steps": [str]}   (progress events meanwhile)
            (a run under a restart policy is not restarted after a stop; during its backoff the stop ends it)
kill_stale  {dry_run, targets: [[pid, create_time]] | None, grace_s}
            -> {"candidates": [HolderInfo], "signalled": [...], "failed": [...]}
stacks      {timeout_s, run_id?}                        -> {"method": str, "text": str}
doctor      {}                                          -> {"checks": [{"name", "ok", "detail", "fix"}]}
sim         {gpu, util_pct, mem_used_mib, holder_pid}   -> {}   only with --simulate-gpus: script an anomalous state
host_map    {ctid}                                      -> HostMap fields; run on a Proxmox host: NVML's processes
                                                           there, each mapped to its container and its PID inside it
rendezvous  {peers?: [str], port?: int, pick_port?: bool} -> RendezvousReply fields: where a multi-node run's c10d
                                                           store can live here (the route to each peer, a free port)
host_holders {map: HostMap fields | None, error: str | None}
                                                        -> {"accepted", "holders"}; the client hands the host's map to
                                                           the container's agent, whose holders are then exact
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.protocol.payloads import Anomaly, GpuInfo, HolderInfo, HoldersSource, HostMapState, ProcInfo, RunInfo
from engine.protocol.wire import decode_log_data

# Keys every `status --json` object carries (a contract scripts rely on).
STATUS_KEYS: tuple[str, ...] = ("host", "gpus", "processes", "run", "anomalies")

RUNS_MAX_LIMIT = 500  # the most runs one ``runs`` command lists (the CLI refuses more as a usage error)


@dataclass
class LaunchSpec:
    """What to start. ``command`` is an argv list; it is never passed through a shell by the agent."""

    command: list[str]
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    run_id: str | None = None  # default: generated, e.g. 20261129-111500-ab12
    step_pattern: str = r"step=\d+"
    deadlines_s: dict[str, float] = field(default_factory=dict)  # milestone -> seconds after launch
    profile: str | None = None
    # The restart policy, {on: ["crash" | "hang" | "oom"], max, backoff_s, stall_s, grace_s}; None: never restarted.
    restart: dict[str, Any] | None = None


@dataclass
class WaitResult:
    """The `launch --wait --json` object."""

    ok: bool
    milestone: str  # the milestone waited for
    stage: str  # the last milestone (or engine stage) reached
    cause: str | None  # why it failed; None when ok
    exit_code: int | None
    signal: int | None
    elapsed_s: float
    last_lines: list[str] = field(default_factory=list)
    alive: bool | None = None  # process alive at the end of the wait
    detail: str | None = None  # "alive, silent: 3 threads, 0.0% CPU, no GPU" and the like
    run_id: str | None = None
    # True only when a deadline passed with the process alive (exit code 4); a dead engine thread is a
    # failure (exit code 1) even though the process is still alive.
    hung: bool = False


@dataclass
class HostSummary:
    """The machine the agent runs on (``status``'s ``host``)."""

    hostname: str | None = None
    boot_id: str | None = None
    kernel: str | None = None
    python: str | None = None  # its version
    agent_pid: int | None = None
    agent_uptime_s: float | None = None
    cpu_count: int | None = None
    loadavg: list[float] = field(default_factory=list)
    mem_total_mib: float | None = None
    mem_available_mib: float | None = None
    run_root: str | None = None
    run_root_free_gib: float | None = None
    dev_dir: str | None = None


@dataclass
class ProcessTable:
    """The run's process tree and every GPU holder (``status``'s ``processes``)."""

    run_tree: list[ProcInfo] = field(default_factory=list)
    holders: list[HolderInfo] = field(default_factory=list)


@dataclass
class StatusReply:
    """``status``: one snapshot of the host (its required fields are ``STATUS_KEYS``)."""

    host: HostSummary
    gpus: list[GpuInfo]
    processes: ProcessTable
    run: RunInfo | None
    anomalies: list[Anomaly]
    t: float | None = None
    gpu_source: str | None = None
    simulated: bool = False
    nvml_error: str | None = None  # why NVML is unavailable (None: it works, or GPUs are simulated)
    holders_source: HoldersSource | None = None
    host_map: HostMapState | None = None
    capabilities: dict[str, Any] = field(default_factory=dict)


@dataclass
class ListedRun(RunInfo):
    """One row of ``runs``: the run's RunInfo, how long it ran and whether it is the current run."""

    duration_s: float | None = None
    current: bool = False


@dataclass
class RunsReply:
    runs: list[ListedRun]
    total: int  # runs on the host (``runs`` lists the newest ``limit`` of them)


@dataclass
class RunInfoReply:
    run: RunInfo


@dataclass
class TailReply:
    """``tail``: the last lines of a run's output.log (each ``encode_log_data`` of its bytes)."""

    offset: int  # the byte after the last line: where following continues
    run_id: str
    lines: list[str] = field(default_factory=list)
    inode: int | None = None  # None: the run has no output.log yet
    partial: bool = False  # the last line has no newline yet
    window_cut: bool = False  # long lines overran the reply's byte window: read the bytes with read_log
    start: int | None = None  # with stream: the byte where the last n lines begin
    cut_to: int | None = None  # more lines were asked for than one reply carries
    current: bool = True


@dataclass
class ReadLogReply:
    """``read_log``: bytes of a run's output.log from ``offset``."""

    data: str  # encode_log_data of the bytes
    offset: int
    inode: int
    size: int | None = None
    run_id: str | None = None

    @property
    def raw(self) -> bytes:
        return decode_log_data(self.data)


@dataclass
class StopReply:
    stopped: bool
    steps: list[str] = field(default_factory=list)  # what was done, in order, one sentence each
    escalated: bool | None = None  # SIGKILL was needed
    run_id: str | None = None
    job_pid: int | None = None
    exit: dict[str, Any] | None = None  # the run's exit record (exit.json), as written
    gpu_released: bool | None = None


@dataclass
class LaunchReply:
    run_id: str
    run_dir: str | None = None
    tmux_session: str | None = None
    attachable: bool = False
    attach: list[str] | None = None  # the argv that attaches on the host
    submitted_at: float | None = None
    note: str | None = None
    command: list[str] | None = None


@dataclass
class RendezvousReply:
    """``rendezvous``: where a multi-node run's c10d store can live on this node (engine/agent/net_cmds.py)."""

    hostname: str = ""
    ssh_address: str | None = None  # the address the client's SSH reached this node at; None outside SSH
    ssh_client: str | None = None  # the address that SSH client came from (this node's view of the client)
    routes: dict[str, str | None] = field(default_factory=dict)  # peer -> this node's source address towards it
    port: int | None = None  # with pick_port: the port asked for when free here, else one the kernel gave


@dataclass
class RestartReply:
    previous_run_id: str
    launch: LaunchReply
    stop: StopReply | None = None  # None: the run had ended already


@dataclass
class KillStaleReply:
    """``kill_stale``: the stale holders, and (without dry_run) what was signalled and what failed.

    ``signalled``/``failed``/``left_alone`` entries are the supervisor's records of one process each (pid,
    create_time, signals, outcome or reason, ...), shown as they are."""

    candidates: list[HolderInfo] = field(default_factory=list)
    signalled: list[dict[str, Any]] = field(default_factory=list)
    failed: list[dict[str, Any]] = field(default_factory=list)
    left_alone: list[dict[str, Any]] = field(default_factory=list)
    dry_run: bool | None = None


@dataclass
class ServeCheckReply:
    """``serve_check`` started: its pid, the checkpoint it serves, its log on the host, vLLM's interpreter."""

    pid: int
    checkpoint: str
    log: str
    vllm_python: str


@dataclass
class StacksReply:
    method: str  # how the stacks were taken (py-spy, SIGUSR1 + faulthandler, ...)
    text: str = ""
    ranks: dict[str, int] = field(default_factory=dict)  # a torchrun run: rank -> its pid


@dataclass
class DoctorCheck:
    name: str
    ok: bool
    detail: str = ""
    fix: str | None = None
    level: str = "error"  # "ok" | "warn" | "fail": a warn is ok=False that does not block training


@dataclass
class DoctorReply:
    checks: list[DoctorCheck] = field(default_factory=list)
    ok: bool | None = None
