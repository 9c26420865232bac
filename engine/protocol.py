"""The wire protocol between the host agent and its clients (the TUI and the headless CLI).

Stdlib only: this module is shipped to hosts that have nothing but ``python3``.

Wire format: JSON lines, UTF-8, one object per line.

* agent -> client, on the agent's stdout: events, ``{"ev": <kind>, ...}``.
* client -> agent, on the agent's stdin: commands, ``{"id": <int>, "cmd": <name>, "args": {...}}``.
  Every command gets exactly one ``reply`` event with the same ``id``.

Bytes of a log are carried losslessly: the agent decodes them as UTF-8 with
``surrogateescape`` and ``json.dumps`` escapes the lone surrogates, so
``decode_log_data(encode_log_data(b)) == b`` for any bytes ``b``.

The first line an agent prints is always a ``hello`` event.

Three more contracts the client and the host share live at the end of this module: which run ids a host
accepts (``validate_run_id``), the restart policy table a profile carries in its LaunchSpec (``parse_policy``)
and where the client's bundle puts NVIDIA's NVML binding for the host's loader (``VENDOR_DIR``...).

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
warning     message                             something the user should see that is not an error of a command
error       message                             the agent itself hit a problem it cannot attach to a command
            (also: a malformed command line is answered with ``error``; the agent never dies of bad input)

Commands (``cmd``)
------------------
A client decodes each reply it reads into its dataclass below (``StatusReply``, ``RunsReply``, ``TailReply``, ...).

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

import json
import math
import re
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, TypeVar, Union

PROTOCOL_VERSION = 1
AGENT_VERSION = "0.1.0"

# Milestones of a launch, in order.
MILESTONES: tuple[str, ...] = ("submitted", "started", "output", "first-step")

# Keys every `status --json` object carries (a contract scripts rely on).
STATUS_KEYS: tuple[str, ...] = ("host", "gpus", "processes", "run", "anomalies")

# Anomaly kinds (computed on the host, engine/agent/anomalies.py).
ANOMALY_KINDS: tuple[str, ...] = (
    "phantom_utilization",
    "orphan_memory",
    "stale_holder",
    "stalled_run",
    "dead_thread",
    "disk_full",  # the run root's filesystem is (nearly) full: records and log cannot be written
    "compile_fallback",  # a compiled function hit dynamo's recompile limit and runs eagerly
    "recompile",  # a compiled function compiled a new graph after its thread's warm-up
    "nonfinite_grad",  # a drafter skipped steps whose gradients were NaN or infinite
    "foreign_holder",  # a GPU of ours is used by a process of another container or of the host (seen from the host)
)

# Where a holder's GPU indices come from (HolderInfo.gpus_source).
GPUS_SOURCES: tuple[str, ...] = (
    "nvml",  # NVML's per-GPU process lists, whose PIDs resolve in this PID namespace
    "fd-scan",  # /proc/<pid>/fd links to /dev/nvidiaN: a CUDA process opens every GPU's node, so not exact
    "host-nvml",  # NVML on the Proxmox host, mapped into this container through NSpid and the cgroup
    "simulated",  # the simulated GPU source
)

# Where a holder lives, seen from the agent (HolderInfo.scope).
HOLDER_SCOPES: tuple[str, ...] = ("here", "container", "host")

# Run states as reported in RunInfo.state.
RUN_STATES: tuple[str, ...] = (
    "starting",  # launch.json not yet written
    "running",  # pid alive
    "exited",  # exit.json says code 0
    "failed",  # exit.json says non-zero code or a signal
    "stopped",  # exit.json says it ended because it was asked to stop, cleanly (torchrun's exit 1 on SIGTERM too)
    "vanished",  # pid gone, no exit.json (killed -9 wrapper, tmux server killed, ...)
    "rebooted",  # launch.json's boot id differs from the host's: ended by reboot
)

# `launch --wait` exit codes (README).
EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_CONNECTION = 3
EXIT_HUNG = 4

RUNS_MAX_LIMIT = 500  # the most runs one ``runs`` command lists (the CLI refuses more as a usage error)

# Environment variables the supervisor sets for the job (the engine writes its events there).
ENV_RUN_DIR = "SPECDEC_RUN_DIR"
ENV_EVENTS_PATH = "SPECDEC_EVENTS"
ENV_RUN_ID = "SPECDEC_RUN_ID"
ENV_ATTEMPT = "SPECDEC_ATTEMPT"  # 1 for the first start, 2 for the first restart under a restart policy, ...
# A run over several nodes: the client's launch sets them on every node (one run id everywhere), and the launch
# record keeps them, so a later stop or restart can tell the multi-node run from another run of that node.
ENV_NNODES = "SPECDEC_NNODES"
ENV_NODE_RANK = "SPECDEC_NODE_RANK"


class ProtocolError(ValueError):
    """A line that is not a valid protocol message."""


@dataclass
class HolderGpu:
    """One GPU a holder has a context on, with the memory NVML charges to it there (None: not reported)."""

    gpu: int
    used_mib: float | None = None


@dataclass
class HolderInfo:
    """A process that holds an NVIDIA device (through NVML or a /dev/nvidia* descriptor)."""

    pid: int
    resolved: bool  # False: NVML reported a PID we cannot see (host PID seen from a container)
    create_time: float | None = None
    user: str | None = None
    cmd: str | None = None
    gpus: list[int] = field(default_factory=list)
    used_mib: float | None = None
    state: str | None = None  # psutil status: "running", "sleeping", "zombie", "disk-sleep", ...
    age_s: float | None = None
    in_run: bool = False  # part of the current run's process tree
    source: str = "fd"  # "fd" | "nvml" | "fd+nvml" | "simulated"
    # True: NVML lists it with a GPU context. False: NVML's list is proven to be in our PID namespace
    # and this process is not on it (a device handle only: nvidia-smi, nvitop, an idle import). None: unknown.
    context: bool | None = None
    gpus_source: str | None = None  # one of GPUS_SOURCES; None when it holds no GPU (nvidiactl only)
    per_gpu: list[HolderGpu] = field(default_factory=list)  # exact per-GPU memory when NVML gave it
    # "here": a process of this PID namespace. "container"/"host": seen only from the Proxmox host (``pid`` is then
    # the host PID, ``resolved`` False): never a stale holder of ours, never signalled from here.
    scope: str = "here"
    container: str | None = None  # the LXC container id the process lives in, when known from the host
    host_pid: int | None = None  # its PID on the Proxmox host, when known from the host


@dataclass
class HostProcess:
    """One NVML process on the Proxmox host, mapped into the container that holds it (``host_map``)."""

    host_pid: int
    gpu_uuid: str
    host_gpu: int  # the GPU's index on the host (a container may number its GPUs differently)
    used_mib: float | None
    container: str | None  # LXC container id from the cgroup; None: the host itself (or a non-LXC cgroup)
    ns_pid: int | None  # its PID in the container's PID namespace (NSpid); None when it is not in a child namespace
    nspid: list[int] = field(default_factory=list)  # every NSpid field, host first
    start_ticks: int | None = None  # /proc/<pid>/stat starttime: the same number inside the container (one kernel)
    cgroup: str | None = None
    cmd: str | None = None
    user: str | None = None
    exists: bool = True  # False: NVML listed it but /proc has no such process (exited since)


@dataclass
class HostGpu:
    uuid: str
    index: int
    util_pct: float | None
    mem_used_mib: float | None


@dataclass
class HostMap:
    """What the Proxmox host's NVML says, each process placed in its container (or on the host)."""

    t: float
    ctid: str
    hostname: str
    gpus: list[HostGpu] = field(default_factory=list)
    processes: list[HostProcess] = field(default_factory=list)
    source: str = "nvml"  # "nvml" | "simulated"
    error: str | None = None  # why there is no map (no NVML on the host, ...)


@dataclass
class GpuInfo:
    index: int
    name: str
    uuid: str
    util_pct: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    temp_c: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    holder_pids: list[int] = field(default_factory=list)
    simulated: bool = False
    unsupported: list[str] = field(default_factory=list)  # NVML fields this driver does not answer


@dataclass
class ThreadInfo:
    tid: int
    name: str


@dataclass
class ProcInfo:
    pid: int
    ppid: int
    user: str | None
    cmd: str
    cpu_pct: float | None
    rss_mib: float | None
    create_time: float | None
    state: str | None
    threads: list[ThreadInfo] = field(default_factory=list)


@dataclass
class Anomaly:
    kind: str  # one of ANOMALY_KINDS
    message: str  # a sentence a person can act on
    gpu: int | None = None
    pid: int | None = None
    thread: str | None = None


@dataclass
class RunInfo:
    """The current run as read from its run directory and the process table."""

    run_id: str
    run_dir: str
    state: str  # one of RUN_STATES
    command: list[str] = field(default_factory=list)
    cwd: str | None = None
    pid: int | None = None
    pgid: int | None = None
    boot_id: str | None = None
    started_at: float | None = None
    ended_at: float | None = None
    tmux_session: str | None = None
    attachable: bool = False  # False when tmux was missing and the run was started with setsid
    exit_code: int | None = None
    signal: int | None = None
    milestones: dict[str, float | None] = field(default_factory=dict)  # milestone -> unix time reached
    stage: str | None = None  # last engine stage, when the job is our engine
    last_step: int | None = None
    last_step_at: float | None = None
    profile: str | None = None
    cause: str | None = None  # why it failed when the records say more than an exit code (e.g. never started)
    # Under a restart policy (restarts.json): every restart, oldest first, as
    # {attempt (the attempt that ended), cause ("crash" | "hang" | "oom"), at, exit_code, signal, detail,
    #  restarted_at, first_output_at, ...}; restart_max is the policy's max (None: no policy); restart_state one of
    # "watching" | "backoff" | "gave_up" | "cancelled" | "done".
    restarts: list[dict[str, Any]] = field(default_factory=list)
    restart_max: int | None = None
    restart_state: str | None = None
    last_export: str | None = None  # the newest `specdec-train export` of this run's checkpoints (its OUT_DIR)
    # The engine's output directory (checkpoints; what `specdec-train export` takes), from <run dir>/checkpoints;
    # None for a command that is not the engine.
    output_dir: str | None = None
    failed_rank: int | None = None  # a torchrun run: the global rank that failed first (its node below), when named
    failed_node: int | None = None
    # Bytes of its events files the scan left unread (the middle of a huge file: stage and step come from its
    # head and tail); 0: every line was read.
    events_unread_bytes: int = 0
    # A run launched over several nodes (its launch's ENV_NNODES / ENV_NODE_RANK): how many, and this node's rank.
    nnodes: int | None = None
    node_rank: int | None = None


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


def to_jsonable(obj: Any) -> Any:
    """Dataclasses to dicts; non-finite floats to None (JSON has no NaN)."""
    if hasattr(obj, "__dataclass_fields__"):
        obj = asdict(obj)
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def encode(msg: dict[str, Any]) -> bytes:
    """One protocol line, newline included."""
    return (json.dumps(to_jsonable(msg), separators=(",", ":"), ensure_ascii=True) + "\n").encode("ascii")


def event(ev: str, **fields: Any) -> dict[str, Any]:
    return {"ev": ev, **fields}


def command(cmd_id: int, cmd: str, **args: Any) -> dict[str, Any]:
    return {"id": cmd_id, "cmd": cmd, "args": args}


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number out of range: {text[:40]}")
    return value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a protocol value")  # encode() never writes NaN or Infinity


def decode(line: bytes | str) -> dict[str, Any]:
    """Parse one protocol line; raises ProtocolError for anything that is not a JSON object.

    Every way a line can fail to decode ends here as a ProtocolError, never as another exception: invalid UTF-8,
    malformed JSON, an integer over Python's digit limit (a ValueError), a float out of range, nesting deep
    enough to exhaust the stack (RecursionError), or a line too large for memory."""
    try:
        text = line.decode("utf-8") if isinstance(line, bytes) else line
        obj = json.loads(text, parse_float=_finite_float, parse_constant=_no_constant)
    except (ValueError, RecursionError, MemoryError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ProtocolError(f"not a JSON line: {str(exc)[:200]}") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def parse_command(line: bytes | str) -> tuple[int | None, str, dict[str, Any]]:
    """Validate a command line: returns (id, cmd, args) or raises ProtocolError."""
    obj = decode(line)
    cmd_id = obj.get("id")
    if cmd_id is not None and (not isinstance(cmd_id, int) or isinstance(cmd_id, bool)):
        raise ProtocolError("command id must be an integer")
    cmd = obj.get("cmd")
    if not isinstance(cmd, str) or not cmd:
        raise ProtocolError("command has no 'cmd' string")
    args = obj.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError("command 'args' must be an object")
    return cmd_id, cmd, args


def parse_event(line: bytes | str) -> dict[str, Any]:
    """Validate an event line: returns the object or raises ProtocolError."""
    obj = decode(line)
    if not isinstance(obj.get("ev"), str):
        raise ProtocolError("event has no 'ev' string")
    return obj


def encode_log_data(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


def decode_log_data(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


# -- typed events ------------------------------------------------------------------------------------
# What a client reads: every event above as a dataclass, decoded once (``decode_event``) where the line
# arrives. The wire stays the JSON objects documented at the top; unknown keys are ignored (a field added
# on one side never breaks the other), a missing required key or a value of the wrong type is a
# ProtocolError. Engine events (the ``event`` of an ``engine`` line) are chosen by their ``kind``.
#
# Engine events are the one contract of <run_dir>/events.jsonl (one JSON object per line, written by
# engine/trainer, read by the agent's anomalies, the supervisor's scanner and the dashboard): one dataclass per
# ``kind`` (its KIND), its fields the keys, ``t`` the unix time; a torchrun rank tags each with rank, node and
# world_size. ``encode_engine_event`` writes one, ``decode_engine_event`` reads one back.


# A draft vocabulary holding less of the trained tokens than this leaves the drafter unable to propose the rest.
VOCAB_COVERAGE_WARN = 0.90


@dataclass
class StageEvent:
    """stage: "imports" | "target_loaded" | "data" | "warmup" | "training" | "checkpoint" | "stopping" | "done" |
    "distributed" (a torchrun rank joined: its pid, local rank, local world size and collective backend) |
    "fp8_agreement" (an FP8 target against the exact one, in its detail). The "data" stage's summary adds skipped
    ({reason: conversations not trained on}), heldout, truncated, bad_lines and cached; its draft-vocabulary line
    adds vocab_coverage (below VOCAB_COVERAGE_WARN the engine warns and the dashboard says so)."""

    KIND: ClassVar[str] = "stage"
    stage: str
    thread: str | None = None
    detail: str = ""
    t: float | None = None
    rank: int | None = None  # torchrun rank (every event of a rank's events file carries it)
    node: int | None = None
    world_size: int | None = None
    pid: int | None = None  # the "distributed" stage: the rank's process, its local rank and how many share the node
    local_rank: int | None = None
    local_world_size: int | None = None
    backend: str | None = None  # the "distributed" stage: "nccl" | "gloo"
    skipped: dict[str, int] | None = None  # the "data" stage: conversations not trained on, by reason
    heldout: int | None = None  # conversations held out for evaluation
    truncated: int | None = None  # conversations cut to the longest bucket
    bad_lines: list[str] | None = None  # "file:line: reason" of the first malformed lines
    cached: bool | None = None  # the tokenized data came from the cache
    vocab_coverage: float | None = None  # share of the trained (loss-masked) tokens the draft vocabulary holds


@dataclass
class HeartbeatEvent:
    """A thread is alive: its state, step, throughput and queue depth (a hung thread's heartbeats age)."""

    KIND: ClassVar[str] = "heartbeat"
    thread: str
    state: str = "unknown"  # "starting" | "warmup" | "training" | "waiting" | "syncing" | "stopped" | "error"
    step: int | None = None
    tok_s: float | None = None
    queue_depth: int | None = None
    last_exception: str | None = None
    role: str | None = None  # "drafter" | "producer" | ...
    flags: list[str] = field(default_factory=list)  # raised by the trainer's health board: "stalled", "starving"
    beat_age_s: float | None = None  # seconds since the thread last beat, when this line was written
    t: float | None = None  # when the thread last beat (a hung thread's heartbeats age)
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class StepEvent:
    """A training step: loss and acceptance per TTT position, loss_total (the loss trained on, the log line's
    ``loss=``), tokens per second and ms per phase ({"fetch", "fwd", "bwd", "opt"})."""

    KIND: ClassVar[str] = "step"
    step: int
    thread: str | None = None
    loss: list[float | None] = field(default_factory=list)  # per TTT position (None: not finite)
    acc: list[float | None] = field(default_factory=list)
    loss_total: float | None = None  # sum_i 0.8**i * loss_i: the loss trained on
    tok_s: float | None = None
    # Tokens inside conversations a second, padding left out; None when the batch had no padding (== tok_s).
    useful_tok_s: float | None = None
    ms: dict[str, float | None] = field(default_factory=dict)
    grad_norm: float | None = None  # before clipping; None when the step was skipped (not finite)
    skipped: bool = False  # non-finite gradients: the optimizer did not step
    lr: float | None = None
    bucket: int | None = None  # the padded sequence length of the batch
    # The producer's host time for the batch that was trained: reading it, moving it and the target's forward. On
    # CUDA that is mostly the time to queue the forward's kernels, not their run time (bench_engine's profile has that).
    target_ms: float | None = None
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class ThreadErrorEvent:
    """A thread died of an exception; ``policy`` says whether the run stops or continues without it."""

    KIND: ClassVar[str] = "thread_error"
    thread: str
    exc_type: str = "Error"
    message: str = ""
    traceback: str | None = None
    policy: str = "stop"  # "stop" | "continue"
    role: str | None = None  # "drafter" | "producer" | ...
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class CheckpointEvent:
    """A checkpoint was written."""

    KIND: ClassVar[str] = "checkpoint"
    step: int
    path: str
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class RunEndEvent:
    """The run ended (ok, or why not)."""

    KIND: ClassVar[str] = "run_end"
    ok: bool
    reason: str = ""
    step: int | None = None
    degraded: list[str] | None = None  # threads that died under the ``continue`` policy (the run went on without them)
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class CompileEvent:
    """A recompile after warm-up or a fallback to eager (the guard of engine/trainer)."""

    KIND: ClassVar[str] = "compile"
    what: str  # "recompile" | "fallback"
    function: str | None = None
    thread: str | None = None
    graphs: int | None = None
    limit: int | None = None
    signature: str | None = None
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class ExportEvent:
    """``specdec-train export`` wrote a servable drafter (appended after the run too)."""

    KIND: ClassVar[str] = "export"
    path: str
    checkpoint: str | None = None
    step: int | None = None
    format: str | None = None
    drafter: str | None = None
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class EvalEvent:
    """Acceptance on held-out prompts: tau (mean tokens per target forward in greedy chain speculation), k,
    per_position [P(draft token j accepted), j = 1..k], per_position_conditional [P(j accepted | j-1 accepted)],
    rounds, prompts, new_tokens; or ``error`` when the evaluation failed."""

    KIND: ClassVar[str] = "eval"
    thread: str
    step: int
    tau: float | None = None
    k: int | None = None
    per_position: list[float | None] = field(default_factory=list)
    per_position_conditional: list[float | None] = field(default_factory=list)
    rounds: int | None = None
    prompts: int | None = None
    new_tokens: int | None = None
    counting: str | None = None  # how a round's accepted tokens are counted: "stop" | "vllm"
    accepted_per_position: list[int] = field(default_factory=list)  # rounds whose proposal j was accepted
    accepted_hist: list[int] = field(default_factory=list)  # [rounds that accepted exactly a tokens, a = 0..k]
    eval_s: float | None = None  # how long the evaluation took
    error: str | None = None  # the evaluation failed (then no tau)
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class NonFiniteGradEvent:
    KIND: ClassVar[str] = "nonfinite_grad"
    thread: str
    step: int
    grad_norm: str = "nan"  # "nan" | "inf": JSON has no such numbers
    in_a_row: int = 1  # skipped steps in a row, this one included
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class ServedEvent:
    """A run's export served by vLLM with its target (``specdec-train serve-check``): vLLM's acceptance length
    ``tau`` and per-position rates P(draft token j accepted) on the run's held-out prompts, next to ours on the same
    prompt ids in the same (vLLM's) counting, ``tau_ours``; or ``error`` (vLLM absent or failed)."""

    KIND: ClassVar[str] = "served"
    export: str | None = None  # the export directory served
    step: int | None = None  # the checkpoint's step
    k: int | None = None
    tau: float | None = None  # vLLM's
    tau_ours: float | None = None
    per_position: list[float | None] = field(default_factory=list)
    prompts: int | None = None
    outputs_equal: int | None = None  # prompts whose speculative output equals the target's greedy one
    vllm: str | None = None  # its version
    error: str | None = None
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


# Union[...], not X | Y: evaluated when the module loads, on hosts whose python3 may predate 3.10.
EngineEvent = Union[  # noqa: UP007
    StageEvent,
    HeartbeatEvent,
    StepEvent,
    ThreadErrorEvent,
    CheckpointEvent,
    RunEndEvent,
    CompileEvent,
    ExportEvent,
    EvalEvent,
    NonFiniteGradEvent,
    ServedEvent,
]

# The kinds, derived from the dataclasses: a kind is written once, as its class's KIND.
ENGINE_EVENT_KINDS: tuple[str, ...] = tuple(cls.KIND for cls in typing.get_args(EngineEvent))


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
class HoldersSource:
    """Where the holders' GPU indices come from (one of GPUS_SOURCES), in one sentence."""

    source: str
    detail: str = ""


@dataclass
class HostMapState:
    """Under --pct: whether the Proxmox host's view is in use ("ok" | "stale" | "unavailable"), and why not."""

    state: str
    detail: str | None = None
    ctid: str | int | None = None


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

# -- typed replies -----------------------------------------------------------------------------------
# What a client reads of a command's ``result``: decoded once where the reply arrives (``from_json(cls,
# result, cmd)``), with the events' rules: unknown keys ignored, a missing or mistyped field a ProtocolError
# naming it. The reply stays on the wire as the agent sent it (``status --json`` prints that object).


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


EVENT_TYPES: dict[str, type[Any]] = {cls.EV: cls for cls in typing.get_args(Event)}
ENGINE_EVENT_TYPES: dict[str, type[Any]] = {cls.KIND: cls for cls in typing.get_args(EngineEvent)}

T = TypeVar("T")


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


def decode_engine_event(obj: Any) -> EngineEvent:
    """One line of events.jsonl (parsed) as its dataclass, chosen by ``kind``; raises ProtocolError."""
    try:
        decoded: EngineEvent = _decoder(EngineEvent)(obj)
    except _Mismatch as exc:
        raise ProtocolError(f"event{exc.path}: {exc.what}") from None
    return decoded


def encode_engine_event(ev: EngineEvent) -> dict[str, Any]:
    """The JSON object of an engine event, as a line of events.jsonl holds it (``decode_engine_event``'s inverse):
    ``kind`` first, then the fields, less those that are None by default and None now."""
    out: dict[str, Any] = {"kind": ev.KIND}
    for f in fields(ev):
        value = getattr(ev, f.name)
        if value is None and f.default is None:
            continue
        out[f.name] = to_jsonable(value)
    return out


def decode_engine_line(line: bytes | str) -> EngineEvent | None:
    """One line of events.jsonl as its engine event; None for a line that is not one (torn, of an unknown kind, a
    field of the wrong type): a reader of the file skips it, as the dashboard skips it on the wire."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    try:
        return decode_engine_event(obj)
    except ProtocolError:
        return None


def from_json(cls: type[T], obj: Any, where: str | None = None) -> T:
    """A dataclass from a JSON object, every field checked against its annotation (ints pass as floats)."""
    try:
        decoded: T = _decoder(cls)(obj)
    except _Mismatch as exc:
        raise ProtocolError(f"{where or cls.__name__}{exc.path}: {exc.what}") from None
    return decoded


def decode_as(tp: Any, value: Any) -> Any:
    """One JSON value checked against the annotation ``tp`` and converted (an int passes for a float, a bool never
    for a number); raises ProtocolError. The typed-JSON decoder of every reader above, for one field at a time."""
    try:
        return _decoder(tp)(value)
    except _Mismatch as exc:
        raise ProtocolError(f"value{exc.path}: {exc.what}") from None


# A decoder per annotation, built once: it checks and converts one JSON value. The path to a bad value is
# assembled only on the way out of a failure, so a valid event costs a few dict look-ups per field.

Decoder = Callable[[Any], Any]


class _Mismatch(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path = ""

    def under(self, step: str) -> _Mismatch:
        self.path = step + self.path
        return self


_DECODERS: dict[Any, Decoder] = {}


def _decoder(tp: Any) -> Decoder:
    found = _DECODERS.get(tp)
    if found is None:
        found = _DECODERS[tp] = _build(tp)
    return found


def _got(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _exact(kind: type[Any], expected: str) -> Decoder:
    def decode(value: Any) -> Any:
        if type(value) is kind:  # exact type: a bool is not an int here
            return value
        raise _Mismatch(f"expected {expected}, got {_got(value)}")

    return decode


def _number(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise _Mismatch(f"expected a number, got {_got(value)}")


def _null(value: Any) -> None:
    if value is not None:
        raise _Mismatch(f"expected null, got {_got(value)}")


def _build(tp: Any) -> Decoder:
    if tp is Any:
        return lambda value: value
    if tp is type(None):
        return _null
    simple = {bool: _exact(bool, "true/false"), int: _exact(int, "an integer"), str: _exact(str, "a string")}
    if tp in simple:
        return simple[tp]
    if tp is float:
        return _number
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return _union(typing.get_args(tp))
    if origin is list:
        return _list(_decoder(typing.get_args(tp)[0]))
    if origin is dict:
        return _dict(_decoder(typing.get_args(tp)[1]))
    if isinstance(tp, type) and is_dataclass(tp):
        return _dataclass(tp)
    raise TypeError(f"no decoder for {tp!r}")  # a field annotated with a type this module does not map


def _union(args: tuple[Any, ...]) -> Decoder:
    options = [a for a in args if a is not type(None)]
    nullable = len(options) < len(args)
    tagged = {a.KIND: _decoder(a) for a in options if isinstance(a, type) and is_dataclass(a) and hasattr(a, "KIND")}
    if tagged:  # engine events: chosen by their kind

        def by_kind(value: Any) -> Any:
            if value is None and nullable:
                return None
            kind = value.get("kind") if type(value) is dict else None
            decode = tagged.get(kind) if isinstance(kind, str) else None
            if decode is None:
                raise _Mismatch(f"unknown engine event kind {kind!r}")
            try:
                return decode(value)
            except _Mismatch as exc:
                raise exc.under(f" ({kind})") from None

        return by_kind
    decoders = [_decoder(a) for a in options]
    if len(decoders) == 1:
        (only,) = decoders

        def optional(value: Any) -> Any:
            return None if value is None else only(value)

        return optional if nullable else only

    def first_fit(value: Any) -> Any:
        if value is None and nullable:
            return None
        for decode in decoders:
            try:
                return decode(value)
            except _Mismatch:
                continue
        raise _Mismatch(f"{_got(value)} fits none of its types")

    return first_fit


def _list(item: Decoder) -> Decoder:
    def decode(value: Any) -> list[Any]:
        if type(value) is not list:
            raise _Mismatch(f"expected a list, got {_got(value)}")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(item(v))
            except _Mismatch as exc:
                raise exc.under(f"[{i}]") from None
        return out

    return decode


def _dict(item: Decoder) -> Decoder:
    def decode(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise _Mismatch(f"expected an object, got {_got(value)}")
        out = {}
        for k, v in value.items():
            try:
                out[str(k)] = item(v)
            except _Mismatch as exc:
                raise exc.under(f".{k}") from None
        return out

    return decode


def _dataclass(cls: type[Any]) -> Decoder:
    hints = typing.get_type_hints(cls)
    spec = [
        (f.name, _decoder(hints[f.name]), f.default is MISSING and f.default_factory is MISSING) for f in fields(cls)
    ]

    def decode(value: Any) -> Any:
        if type(value) is not dict:
            raise _Mismatch(f"expected an object, got {_got(value)}")
        kwargs = {}
        for name, field_decoder, required in spec:
            if name in value:
                try:
                    kwargs[name] = field_decoder(value[name])
                except _Mismatch as exc:
                    raise exc.under(f".{name}") from None
            elif required:
                raise _Mismatch(f"no {name!r}")
        return cls(**kwargs)

    return decode


# --- run ids: what a host accepts as a run directory and tmux session name (the CLI checks it before sending) ---
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class RunIdError(ValueError):
    """A run id that is not safe as a directory and tmux session name."""


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or RUN_ID_RE.fullmatch(run_id) is None or run_id in (".", ".."):
        raise RunIdError(
            f"invalid run id {run_id!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return run_id


# --- the restart policy: a profile's ``restart`` table, carried in the LaunchSpec, applied by the wrapper ---
CAUSES: tuple[str, ...] = ("crash", "hang", "oom")
POLICY_KEYS: tuple[str, ...] = ("on", "max", "backoff_s", "stall_s", "grace_s")
DEFAULT_ON: tuple[str, ...] = ("crash",)
DEFAULT_MAX = 3
DEFAULT_BACKOFF_S = 30.0
DEFAULT_STALL_S = 1800.0  # the stalled-run anomaly's cap: a step slower than this is not training
DEFAULT_GRACE_S = 30.0  # our engine saves a checkpoint on SIGTERM at the next step boundary


class PolicyError(ValueError):
    """A restart table that cannot be used; ``key`` names the offending key inside it (None: the table)."""

    def __init__(self, key: str | None, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"restart{'.' + key if key else ''}: {problem}")


@dataclass(frozen=True)
class Policy:
    on: tuple[str, ...] = DEFAULT_ON
    max: int = DEFAULT_MAX
    backoff_s: float = DEFAULT_BACKOFF_S
    stall_s: float = DEFAULT_STALL_S
    grace_s: float = DEFAULT_GRACE_S

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["on"] = list(self.on)
        return out

    @property
    def watches_hangs(self) -> bool:
        return "hang" in self.on and self.max > 0


def _policy_seconds(raw: dict[str, Any], key: str, default: float, positive: bool) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise PolicyError(key, f"must be a number of seconds, got {value!r}")
    if positive and value <= 0:
        raise PolicyError(key, f"must be a positive number of seconds, got {value!r}")
    if value < 0:
        raise PolicyError(key, f"must not be negative, got {value!r}")
    return float(value)


def parse_policy(raw: Any) -> Policy:
    """A Policy from a profile's ``restart`` table (or the LaunchSpec's ``restart`` dict); PolicyError names the key."""
    if isinstance(raw, Policy):
        return raw
    if not isinstance(raw, dict):
        raise PolicyError(None, f'must be a table such as {{ on = ["crash", "hang", "oom"], max = 3 }}, got {raw!r}')
    unknown = sorted(str(k) for k in raw if k not in POLICY_KEYS)
    if unknown:
        raise PolicyError(unknown[0], f"unknown key; allowed: {', '.join(POLICY_KEYS)}")
    on_raw = raw.get("on", list(DEFAULT_ON))
    if not isinstance(on_raw, list) or not all(isinstance(c, str) for c in on_raw):
        raise PolicyError("on", f"must be a list of causes among {', '.join(CAUSES)}, got {on_raw!r}")
    for cause in on_raw:
        if cause not in CAUSES:
            raise PolicyError("on", f"unknown cause {cause!r}; allowed: {', '.join(CAUSES)}")
    max_raw = raw.get("max", DEFAULT_MAX)
    if isinstance(max_raw, bool) or not isinstance(max_raw, int):
        raise PolicyError("max", f"must be a whole number of restarts, got {max_raw!r}")
    if max_raw < 0:
        raise PolicyError("max", f"must not be negative, got {max_raw}")
    return Policy(
        on=tuple(c for c in CAUSES if c in on_raw),
        max=max_raw,
        backoff_s=_policy_seconds(raw, "backoff_s", DEFAULT_BACKOFF_S, positive=False),
        stall_s=_policy_seconds(raw, "stall_s", DEFAULT_STALL_S, positive=True),
        grace_s=_policy_seconds(raw, "grace_s", DEFAULT_GRACE_S, positive=False),
    )


# --- the bundled NVML binding: where the client's bundle puts NVIDIA's pynvml and the host's loader finds it ---
VENDOR_DIR = "_vendor"  # a folder beside `engine/` in the bundle (not a package: nothing imports it by name)
VENDORED_MODULE = "pynvml.py"
VENDORED_LICENSE = "pynvml.LICENSE"
VENDORED_MANIFEST = "pynvml.json"  # {"distribution": "nvidia-ml-py", "version": ..., "sha256": ...}
NVML_DISTRIBUTION = "nvidia-ml-py"
