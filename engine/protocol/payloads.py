"""Payloads: the host's things that events and replies both carry, as plain dataclasses.

GPUs (``GpuInfo``), the run's processes (``ProcInfo``, ``ThreadInfo``), the holders of NVIDIA devices
(``HolderInfo``, ``HolderGpu``, where their GPU indices come from: ``HoldersSource``), the Proxmox host's view
(``HostMap``, ``HostGpu``, ``HostProcess``, ``HostMapState``), anomalies and the current run (``RunInfo``), with
the value sets their string fields take (``ANOMALY_KINDS``, ``GPUS_SOURCES``, ``HOLDER_SCOPES``, ``RUN_STATES``).
No behaviour: the agent fills them, ``to_jsonable`` writes them, ``from_json`` reads them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
