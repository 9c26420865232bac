"""The anomalies the agent flags, as pure functions of samples and engine events.

GPU side, from one GPU sample + the holders + the run's process tree:
* phantom utilization: util >= 90 % with ~0 MiB used and no holder process at all;
* orphan memory: memory used with no live holder we can resolve;
* stale holder: a resolved process holding a GPU that is not in the current run's process tree, named with
  its GPUs only when NVML gave them (the /proc/*/fd scan cannot tell which GPU a CUDA process uses);
* foreign holder: a GPU of this container used by another container's or the host's process (``--pct``).

Host side, from the run root's filesystem:
* disk full: so little space left where the run's records and log live that they cannot be written.

Engine side, from the run's events.jsonl (each line decoded once into engine.protocol's engine events):
* stalled run: no step for k x the median step interval (clamped to [floor, cap]);
* dead thread: a ``thread_error`` event, a heartbeat in state "error", or heartbeats older than a bound;
* compile fallback: a ``compile`` event whose function hit dynamo's recompile limit and now runs eagerly;
* recompile: ``compile`` events for graphs compiled after a thread's warm-up (each stalls that thread);
* non-finite gradients: ``nonfinite_grad`` events, steps a drafter skipped because its gradients were NaN or
  infinite (its weights did not take them).
"""

from __future__ import annotations

import itertools
import os
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from engine.host.disk import full_usage
from engine.host.procs import is_system_holder
from engine.protocol import (
    Anomaly,
    CompileEvent,
    EngineEvent,
    GpuInfo,
    HeartbeatEvent,
    HolderInfo,
    NonFiniteGradEvent,
    RunEndEvent,
    StageEvent,
    StepEvent,
    ThreadErrorEvent,
)

PHANTOM_UTIL_PCT = 90.0
NEAR_ZERO_MIB = 64.0  # "~0 MiB": an idle context-free GPU reports a few MiB at most
ORPHAN_MIN_MIB = 256.0  # less than this is driver bookkeeping, not someone's tensors


STALL_K = 5.0
STALL_FLOOR_S = 60.0
STALL_CAP_S = 1800.0
HEARTBEAT_TIMEOUT_S = 120.0
_STEP_HISTORY = 256
THREADS_KEPT = 256  # per table of EngineState: a job that names ever new threads cannot grow the agent without end


def _short(cmd: str | None, limit: int = 60) -> str:
    if not cmd:
        return "?"
    return cmd if len(cmd) <= limit else cmd[: limit - 1] + "…"


def _foreign_text(h: HolderInfo) -> str:
    where = f"container {h.container}" if h.scope == "container" else "the Proxmox host"
    mem = f", {h.used_mib:.0f} MiB" if h.used_mib else ""
    return f"{where} (host pid {h.host_pid or h.pid}: {_short(h.cmd, 40)}{mem})"


def gpu_anomalies(
    gpus: list[GpuInfo],
    holders: list[HolderInfo],
    run_pids: set[int] | frozenset[int],
    run_active: bool,
    host_view: bool = False,
    agents: set[int] | frozenset[int] = frozenset(),
) -> list[Anomaly]:
    """Phantom utilization, orphan memory, foreign and stale holders, in GPU order then pid order.

    ``host_view``: the holders come from the Proxmox host's NVML (host_map.py), which sees every container
    and the host: a GPU with no holder there has none anywhere. ``agents``: the live specdec agents' pids (as they
    recorded themselves), never stale holders.
    """
    out: list[Anomaly] = []
    for gpu in gpus:
        on_gpu = [h for h in holders if gpu.index in h.gpus]
        ours = [h for h in on_gpu if h.scope == "here"]
        foreign = [h for h in on_gpu if h.scope != "here"]
        any_pid = {h.pid for h in on_gpu} | (set() if host_view else set(gpu.holder_pids))
        resolved = [h for h in ours if h.resolved and h.state != "zombie"]
        unresolved = sorted(h.pid for h in ours if not h.resolved)
        label = "simulated GPU" if gpu.simulated else "GPU"
        util, mem = gpu.util_pct, gpu.mem_used_mib
        if util is not None and mem is not None and util >= PHANTOM_UTIL_PCT and mem < NEAR_ZERO_MIB and not any_pid:
            why = (
                "the Proxmox host's NVML lists no process on it, in any container or on the host: a phantom (a stuck "
                "context or kernel); reset the GPU on the host if it persists"
                if host_view
                else "a stuck context or a job outside this view; check `nvidia-smi` on the host, and reset the GPU "
                "if it persists"
            )
            out.append(
                Anomaly(
                    kind="phantom_utilization",
                    gpu=gpu.index,
                    message=(
                        f"{label} {gpu.index} shows {util:.0f}% utilization with {mem:.0f} MiB used and no process "
                        f"holding it: {why}"
                    ),
                )
            )
        if foreign:
            busy = f" ({util:.0f}% busy)" if util is not None else ""
            out.append(
                Anomaly(
                    kind="foreign_holder",
                    gpu=gpu.index,
                    message=(
                        f"{label} {gpu.index}{busy} is used from outside this container: "
                        + "; ".join(_foreign_text(h) for h in foreign)
                        + " (seen from the Proxmox host); not ours to stop"
                    ),
                )
            )
        if mem is not None and mem >= ORPHAN_MIN_MIB and not resolved and not foreign:
            zombies = sorted(h.pid for h in ours if h.resolved and h.state == "zombie")
            if unresolved:
                why = (
                    f"held by pid {', '.join(map(str, unresolved))} which this PID namespace cannot see "
                    "(another container or the host)"
                )
            elif zombies:
                why = f"its holder {', '.join(map(str, zombies))} is a zombie; its parent must reap it"
            elif host_view:
                why = "the Proxmox host's NVML lists no process on it (a dead process whose memory is not released)"
            else:
                why = "no live process holds it (a dead process whose memory the driver has not released)"
            out.append(
                Anomaly(kind="orphan_memory", gpu=gpu.index, message=f"{label} {gpu.index}: {mem:.0f} MiB used, {why}")
            )
    for h in holders:
        if h.scope != "here" or not h.resolved or h.in_run or h.pid in run_pids or is_system_holder(h, agents):
            continue  # another container's or the host's process is never a stale holder of ours
        if h.state == "zombie":
            continue  # a zombie cannot be stopped, only reaped: orphan memory says so
        if not h.gpus and not h.used_mib:
            continue  # holds only nvidiactl/nvidia-uvm: no GPU of its own
        if h.context is False:
            continue  # a device handle without a GPU context (nvidia-smi, nvitop): holds no GPU memory
        exact = h.gpus_source != "fd-scan"
        if exact and h.gpus:
            where = ", ".join(f"GPU {g}" for g in h.gpus)
        elif h.gpus:
            nodes = ", ".join(f"/dev/nvidia{g}" for g in h.gpus)
            where = f"GPU unknown (fd scan: it has {nodes} open, as every CUDA process does)"
        else:
            where = "a GPU"
        mem_txt = f" ({h.used_mib:.0f} MiB)" if h.used_mib else ""
        who = f"pid {h.pid} ({h.user or '?'}: {_short(h.cmd)})"
        ctx = "is not part of the current run" if run_active else "no run is active"
        state = f", {h.state}" if h.state and h.state not in ("sleeping", "running") else ""
        out.append(
            Anomaly(
                kind="stale_holder",
                gpu=h.gpus[0] if exact and h.gpus else None,
                pid=h.pid,
                message=f"{who}{state} holds {where}{mem_txt} but {ctx}; `kill-stale` can stop it",
            )
        )
    return out


@dataclass
class EngineState:
    """What the anomaly checks need from a run's engine events, folded one decoded event at a time."""

    step_times: deque[float] = field(default_factory=lambda: deque(maxlen=_STEP_HISTORY))
    last_step: int | None = None
    last_step_at: float | None = None
    heartbeats: dict[str, HeartbeatEvent] = field(default_factory=dict)  # thread -> last heartbeat
    thread_errors: dict[str, ThreadErrorEvent] = field(default_factory=dict)  # thread -> last thread_error
    # (thread, function) -> last compile event of each kind, and how many recompiles after warm-up
    compile_fallbacks: dict[tuple[str, str], CompileEvent] = field(default_factory=dict)
    recompiles: dict[tuple[str, str], CompileEvent] = field(default_factory=dict)
    recompile_counts: dict[tuple[str, str], int] = field(default_factory=dict)
    nonfinite_grads: dict[str, NonFiniteGradEvent] = field(default_factory=dict)  # thread -> last nonfinite_grad
    nonfinite_counts: dict[str, int] = field(default_factory=dict)  # thread -> steps skipped in the run
    stage: str | None = None
    ended: bool = False

    dropped: int = 0  # events about a thread (or function) beyond THREADS_KEPT in their table: not kept

    def _keep(self, table: dict[Any, Any], key: Any, value: Any) -> bool:
        """Set ``table[key]``, unless that would hold more than THREADS_KEPT keys (then counted in ``dropped``)."""
        if key not in table and len(table) >= THREADS_KEPT:
            self.dropped += 1
            return False
        table[key] = value
        return True

    def feed(self, ev: EngineEvent) -> None:
        t = ev.t
        if t is None:
            return
        if isinstance(ev, StepEvent):
            # Several drafter threads report the same step: count one progress time per new step.
            if self.last_step is None or ev.step > self.last_step:
                self.last_step = ev.step
                self.step_times.append(t)
            self.last_step_at = t
        elif isinstance(ev, HeartbeatEvent):
            self._keep(self.heartbeats, ev.thread, ev)
        elif isinstance(ev, ThreadErrorEvent):
            self._keep(self.thread_errors, ev.thread, ev)
        elif isinstance(ev, CompileEvent):
            key = (ev.thread or "?", ev.function or "?")
            if ev.what == "fallback":
                self._keep(self.compile_fallbacks, key, ev)
            elif ev.what == "recompile" and self._keep(self.recompiles, key, ev):
                self.recompile_counts[key] = self.recompile_counts.get(key, 0) + 1
        elif isinstance(ev, NonFiniteGradEvent):
            if self._keep(self.nonfinite_grads, ev.thread, ev):
                self.nonfinite_counts[ev.thread] = self.nonfinite_counts.get(ev.thread, 0) + 1
        elif isinstance(ev, StageEvent):
            self.stage = ev.stage
        elif isinstance(ev, RunEndEvent):
            self.ended = True


def stall_threshold_s(
    step_times: list[float] | deque[float],
    k: float = STALL_K,
    floor_s: float = STALL_FLOOR_S,
    cap_s: float = STALL_CAP_S,
) -> float | None:
    """k x the median interval between steps, clamped to [floor, cap]; None before two steps."""
    times = list(step_times)
    if len(times) < 2:
        return None
    intervals = [b - a for a, b in itertools.pairwise(times) if b >= a]
    if not intervals:
        return None
    return min(cap_s, max(floor_s, k * statistics.median(intervals)))


def stalled_run(
    state: EngineState,
    now: float,
    running: bool,
    k: float = STALL_K,
    floor_s: float = STALL_FLOOR_S,
    cap_s: float = STALL_CAP_S,
) -> Anomaly | None:
    if not running or state.ended or state.last_step_at is None:
        return None
    threshold = stall_threshold_s(state.step_times, k, floor_s, cap_s)
    if threshold is None:
        return None
    idle_s = now - state.last_step_at
    if idle_s <= threshold:
        return None
    times = list(state.step_times)
    median = statistics.median([b - a for a, b in itertools.pairwise(times)])
    return Anomaly(
        kind="stalled_run",
        message=(
            f"no training step for {idle_s:.0f} s after step {state.last_step} (median step {median:.1f} s, "
            f"threshold {threshold:.0f} s); `stacks` shows where every thread is"
        ),
    )


def dead_threads(
    state: EngineState,
    now: float,
    running: bool,
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
) -> list[Anomaly]:
    out: list[Anomaly] = []
    for thread, err in sorted(state.thread_errors.items()):
        exc = err.exc_type or "exception"
        out.append(
            Anomaly(
                kind="dead_thread",
                thread=thread,
                message=f"thread {thread} died: {exc}: {_short(err.message, 160)} (policy {err.policy})",
            )
        )
    if not running or state.ended:
        return out
    for thread, hb in sorted(state.heartbeats.items()):
        if thread in state.thread_errors:
            continue
        hb_state = hb.state
        if hb_state == "stopped":
            continue
        if hb_state == "error":
            last = hb.last_exception or "no exception text"
            out.append(
                Anomaly(
                    kind="dead_thread",
                    thread=thread,
                    message=f"thread {thread} reports an error: {_short(str(last), 160)}",
                )
            )
            continue
        age_s = now - (hb.t if hb.t is not None else now)
        if age_s > heartbeat_timeout_s:
            out.append(
                Anomaly(
                    kind="dead_thread",
                    thread=thread,
                    message=(
                        f"thread {thread} has not sent a heartbeat for {age_s:.0f} s (last state {hb_state}, step "
                        f"{hb.step}); `stacks` shows where it is"
                    ),
                )
            )
    return out


def compile_anomalies(state: EngineState) -> list[Anomaly]:
    """A fallback to eager and recompiles after warm-up, one per (thread, function), for the whole run."""
    out: list[Anomaly] = []
    for (thread, fn), ev in sorted(state.compile_fallbacks.items()):
        out.append(
            Anomaly(
                kind="compile_fallback",
                thread=thread,
                message=(
                    f"{thread}: compile fallback: {fn} hit the recompile limit ({ev.graphs} of "
                    f"{ev.limit} graphs) and runs eagerly for new input shapes (slow); last: "
                    f"{_short(ev.signature or '', 120)}"
                ),
            )
        )
    for (thread, fn), ev in sorted(state.recompiles.items()):
        n = state.recompile_counts.get((thread, fn), 1)
        out.append(
            Anomaly(
                kind="recompile",
                thread=thread,
                message=(
                    f"{thread}: {fn} recompiled {n}x after warm-up (each stalls the thread while it compiles); "
                    f"last for: {_short(ev.signature or '', 120)}"
                    + (f" (the guard that failed: {_short(ev.guard, 120)})" if ev.guard else "")
                ),
            )
        )
    return out


def engine_anomalies(state: EngineState, now: float, running: bool, **limits: float) -> list[Anomaly]:
    """Stalled run, dead threads and compile trouble. ``limits``: k, floor_s, cap_s, heartbeat_timeout_s."""
    out: list[Anomaly] = []
    stall = stalled_run(
        state,
        now,
        running,
        k=limits.get("k", STALL_K),
        floor_s=limits.get("floor_s", STALL_FLOOR_S),
        cap_s=limits.get("cap_s", STALL_CAP_S),
    )
    if stall is not None:
        out.append(stall)
    out.extend(dead_threads(state, now, running, limits.get("heartbeat_timeout_s", HEARTBEAT_TIMEOUT_S)))
    out.extend(compile_anomalies(state))
    out.extend(nonfinite_anomalies(state))
    return out


def nonfinite_anomalies(state: EngineState) -> list[Anomaly]:
    """One per drafter thread that skipped steps for non-finite gradients, for the whole run."""
    return [
        Anomaly(
            kind="nonfinite_grad",
            thread=thread,
            message=(
                f"{thread}: {state.nonfinite_counts.get(thread, 1)} step(s) skipped for non-finite gradients "
                f"(last at step {ev.step}, norm {_short(ev.grad_norm, 20)}): the weights did not "
                "take them; check the learning rate and the data"
            ),
        )
        for thread, ev in sorted(state.nonfinite_grads.items())
    ]


def disk_anomalies(run_root: str | os.PathLike[str]) -> list[Anomaly]:
    """``disk_full`` when the filesystem of the run root (or its nearest existing parent) is (nearly) full."""
    full = full_usage(run_root)
    if full is None:
        return []
    free, total = full
    return [
        Anomaly(
            kind="disk_full",
            message=(
                f"the filesystem of the run root {run_root} is full ({free // 1024} KiB free of "
                f"{total // 1024} KiB): the run's log and records cannot be written, a job writing there "
                "fails and its end may go unrecorded; free space there"
            ),
        )
    ]
