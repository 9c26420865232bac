"""Which processes hold an NVIDIA device: /proc/*/fd links to /dev/nvidia* joined with NVML's per-GPU process lists.

NVML reports host PIDs; inside a container's PID namespace those PIDs do not exist (or belong to
someone else). Such a PID is reported with ``resolved=False``: a state to show, never an error.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from engine.host import procs
from engine.host.gpus import GpuSample
from engine.host.host_map import merge_host_map
from engine.protocol import GpuInfo, HolderGpu, HolderInfo, HostMap


@dataclass
class NvmlView:
    """What the GPU source says about processes: pid -> MiB used and pid -> GPU indices (host PIDs)."""

    pid_used_mib: dict[int, float] = field(default_factory=dict)
    pid_gpus: dict[int, list[int]] = field(default_factory=dict)
    source: str = "nvml"  # "nvml" | "simulated"
    pid_gpu_mib: dict[int, dict[int, float | None]] = field(default_factory=dict)
    listed: bool = False  # every GPU's process list was read
    host_map: HostMap | None = None  # under --pct: the Proxmox host's NVML, mapped into this container
    gpus: list[GpuInfo] = field(default_factory=list)  # this side's GPUs (the host map matches UUIDs)

    @classmethod
    def of_sample(cls, sample: GpuSample, source: str, host_map: HostMap | None) -> NvmlView:
        """The view of one GPU sample; ``source``: the GPU source's name (anything but "simulated" is NVML)."""
        return cls(
            sample.pid_used_mib,
            sample.pid_gpus,
            "simulated" if source == "simulated" else "nvml",
            pid_gpu_mib=dict(sample.pid_gpu_mib),
            listed=sample.processes_listed,
            host_map=host_map,
            gpus=sample.gpus,
        )


def find_holders(
    dev_dir: str | None = None,
    view: NvmlView | None = None,
    run_pids: set[int] | frozenset[int] = frozenset(),
) -> list[HolderInfo]:
    """Every process holding an NVIDIA device, from /proc/*/fd links and what the GPU source lists (``view``).

    A listed pid resolves here when a process with that pid holds a /dev/nvidia* node (or exists with fds we
    may not read): its GPUs are then NVML's (``gpus_source="nvml"``), not the fd scan's, because a CUDA process
    opens every /dev/nvidiaN whichever GPU it uses. A listed pid that does not exist here (container) or that
    exists but holds no /dev/nvidia* node (another namespace's PID reused here) is ``resolved=False``; fd
    holders not on NVML's lists keep ``gpus_source="fd-scan"``. ``view.listed``: every GPU's list was read, so
    an empty list in the host's PID namespace means "no process". ``view.source="simulated"``: the pids come
    from the simulated GPU source; existing is enough. ``view.host_map``: NVML on the Proxmox host mapped into
    this container (engine/host/host_map.py): exact holders here, and processes of other containers or of
    the host shown as such; ``view.gpus`` matches the host's GPUs to ours by UUID.
    """
    dev = dev_dir if dev_dir is not None else procs.default_dev_dir()
    v = view if view is not None else NvmlView()
    now = time.time()
    fd_holders = procs.scan_device_holders(dev)
    nvml, nvml_gpus, nvml_mib, nvml_source = v.pid_used_mib, v.pid_gpus, v.pid_gpu_mib, v.source
    out: dict[int, HolderInfo] = {}
    me = os.getpid()  # the scanning process (the agent, kill-stale) opens /dev/nvidia* for NVML: never a holder
    for pid, nodes in fd_holders.items():
        if pid == me:
            continue
        st = procs.read_stat(pid)
        if st is None:
            continue  # exited since the scan
        h = procs.holder_of(pid, st, now)
        h.gpus = procs.gpu_indices(nodes)
        h.gpus_source = "fd-scan" if h.gpus else None
        h.source = "fd"
        out[pid] = h
    if v.host_map is not None:
        return merge_host_map(out, v.host_map, run_pids, v.gpus, now)
    for pid, used in nvml.items():
        gpus = sorted(set(nvml_gpus.get(pid, [])))
        shares = [HolderGpu(gpu=g, used_mib=mib) for g, mib in sorted(nvml_mib.get(pid, {}).items())]
        known = out.get(pid)
        if known is not None:
            known.source = f"fd+{nvml_source}"
            known.used_mib = used
            if gpus:  # NVML's per-GPU lists are exact; the fd scan names every GPU node a CUDA process opened
                known.gpus, known.gpus_source, known.per_gpu = gpus, nvml_source, shares
            continue
        st = procs.read_stat(pid)
        fds = procs.nvidia_fds(pid, dev) if st is not None and nvml_source == "nvml" else None
        src = nvml_source if gpus else None
        if st is None or (fds is not None and not fds[1]):
            out[pid] = HolderInfo(
                pid=pid, resolved=False, gpus=gpus, used_mib=used, source=nvml_source, gpus_source=src, per_gpu=shares
            )
            continue
        # Exists, fds unreadable (another user's process without privileges): trust NVML.
        h = procs.holder_of(pid, st, now)
        h.gpus, h.used_mib, h.source, h.gpus_source, h.per_gpu = gpus, used, nvml_source, src, shares
        out[pid] = h
    # NVML's process list is in our PID namespace when every pid it names is a local /dev/nvidia* holder (or, when it
    # names none, when it was read in full from the host's namespace); then a holder missing from it has no GPU
    # context (a monitor), on any GPU.
    every_pid_resolves = all(out[p].resolved for p in nvml if p in out)
    same_namespace = (
        nvml_source == "nvml" and every_pid_resolves and (bool(nvml) or (v.listed and procs.in_initial_pid_namespace()))
    )
    for h in out.values():
        h.in_run = h.pid in run_pids
        if h.pid in nvml:
            h.context = True
        elif same_namespace and h.resolved:
            h.context = False
            h.gpus, h.gpus_source = [], None
    return sorted(out.values(), key=lambda h: (not h.resolved, h.pid))


def mark_holders(gpus: list[GpuInfo], holders: list[HolderInfo]) -> None:
    """Add each holder's pid to the ``holder_pids`` of the GPUs it holds."""
    by_gpu: dict[int, set[int]] = {}
    for h in holders:
        for g in h.gpus:
            by_gpu.setdefault(g, set()).add(h.pid)
    for gpu in gpus:
        gpu.holder_pids = sorted(set(gpu.holder_pids) | by_gpu.get(gpu.index, set()))
