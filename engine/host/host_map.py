"""Exact GPU holders inside a Proxmox LXC container, read from the Proxmox host.

Inside a container NVML reports host PIDs, which mean nothing in the container's PID namespace. With
``--pct CTID`` the client also runs an agent on the Proxmox host (outside the container) and asks it
``host_map``: NVML's per-GPU process lists there, each host PID placed

* in a container, by its cgroup: Proxmox puts a container's processes under ``/lxc/<CTID>/ns/...``
  (cgroup v2, ``lxc.cgroup.dir.container.inner = ns``) or ``/lxc/<CTID>/...`` (cgroup v1); plain LXC uses
  ``/lxc.payload.<CTID>/...``. The monitor's ``/lxc.monitor/<CTID>`` runs on the host, outside the container;
* at its PID inside that container, by ``NSpid:`` in ``/proc/<pid>/status``: the PID in every namespace
  from the observer's down to the process's own. Field 1 is the PID one namespace below the host's, which
  for an LXC container is the container's own (for a process of a namespace nested inside the container,
  docker in LXC, it is still the PID the container sees).

The client hands that map to the container's agent (command ``host_holders``); ``merge_host_map`` then
makes the container's holders exact: which of its processes holds which GPU with how much memory, and
which GPUs are used by another container or by the host (never stale holders of ours, never signalled).
A mapped PID is checked against the process here by its start time (/proc/<pid>/stat starttime, counted
by the one kernel both sides share), so a PID that ended and was reused is never taken for the holder.
"""

from __future__ import annotations

import re
import socket
import time
from typing import Any

from engine.host import procs
from engine.host.gpus import GpuSource
from engine.protocol import GpuInfo, HolderGpu, HolderInfo, HostGpu, HostMap, HostProcess

# A container's cgroup path: Proxmox (`/lxc/<CTID>/ns/...`, v1 `/lxc/<CTID>/...`) or plain LXC (`/lxc.payload.<CTID>`).
_LXC_CGROUP = re.compile(r"(?:^|/)(?:lxc/(\d+)|lxc\.payload[./](\d+))(?:/|$)")
HOST_MAP_MAX_AGE_S = 15.0  # an older map no longer describes the GPUs: the container view takes over again


def container_of_cgroup(cgroup_text: str) -> str | None:
    """The LXC container id in a /proc/<pid>/cgroup text (any hierarchy line), None for a host process."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        m = _LXC_CGROUP.search(path)
        if m:
            return m.group(1) or m.group(2)
    return None


def read_cgroup(pid: int, proc_root: str = procs.PROC) -> str | None:
    try:
        with open(f"{proc_root}/{pid}/cgroup", encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except OSError:
        return None


def read_nspid(pid: int, proc_root: str = procs.PROC) -> list[int] | None:
    """The ``NSpid:`` fields of /proc/<pid>/status, the observer's namespace first; None when unreadable."""
    try:
        with open(f"{proc_root}/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"NSpid:"):
                    return [int(f) for f in line.split()[1:]]
    except (OSError, ValueError):
        return None
    return None


def _cgroup_label(text: str | None) -> str | None:
    """The unified (v2) path when there is one, else the first hierarchy's path: what a person reads."""
    if not text:
        return None
    lines = [ln for ln in text.splitlines() if ln]
    for ln in lines:
        if ln.startswith("0::"):
            return ln[3:]
    return lines[0].split(":", 2)[-1] if lines else None


def describe_host_process(pid: int, gpu_uuid: str, host_gpu: int, used_mib: float | None) -> HostProcess:
    """One NVML process of the host placed in its container (or on the host) at its PID there."""
    st = procs.read_stat(pid)
    if st is None:
        return HostProcess(pid, gpu_uuid, host_gpu, used_mib, container=None, ns_pid=None, exists=False)
    nspid = read_nspid(pid) or [pid]
    cgroup = read_cgroup(pid)
    return HostProcess(
        host_pid=pid,
        gpu_uuid=gpu_uuid,
        host_gpu=host_gpu,
        used_mib=used_mib,
        container=container_of_cgroup(cgroup or ""),
        ns_pid=nspid[1] if len(nspid) >= 2 else None,
        nspid=nspid,
        start_ticks=st.start_ticks,
        cgroup=_cgroup_label(cgroup),
        cmd=procs.cmdline_of(pid, st.comm),
        user=procs.user_of(pid),
    )


def build_host_map(source: GpuSource, ctid: str) -> HostMap:
    """Sample the host's GPUs once and place every process NVML lists on them."""
    hostname = socket.gethostname()
    if source.error is not None or source.source == "none":
        return HostMap(t=time.time(), ctid=ctid, hostname=hostname, source=source.source, error=source.error)
    sample = source.sample()
    gpus = [HostGpu(uuid=g.uuid, index=g.index, util_pct=g.util_pct, mem_used_mib=g.mem_used_mib) for g in sample.gpus]
    uuid_of = {g.index: g.uuid for g in sample.gpus}
    found: list[HostProcess] = []
    for pid, per_gpu in sorted(sample.pid_gpu_mib.items()):
        for index, mib in sorted(per_gpu.items()):
            proc = describe_host_process(pid, uuid_of.get(index, f"unknown-{index}"), index, mib)
            if proc.container != ctid:
                # Another tenant's or the host's command line can carry secrets (--api-key ...): the container
                # gets its program name only.
                proc.cmd = (proc.cmd or "").split(" ", 1)[0].rsplit("/", 1)[-1][:32]
            found.append(proc)
    error = None if sample.processes_listed else "NVML on the host did not list the processes of every GPU"
    return HostMap(
        t=sample.t, ctid=ctid, hostname=hostname, gpus=gpus, processes=found, source=source.source, error=error
    )


def host_map_from_json(obj: Any) -> HostMap:
    """A HostMap from its JSON form (what ``host_map`` replied, as the client forwards it); ValueError if malformed."""
    if not isinstance(obj, dict):
        raise ValueError("a host map must be an object")
    try:
        gpus = [HostGpu(**g) for g in obj.get("gpus") or []]
        found = [HostProcess(**p) for p in obj.get("processes") or []]
        return HostMap(
            t=float(obj["t"]),
            ctid=str(obj["ctid"]),
            hostname=str(obj.get("hostname") or "?"),
            gpus=gpus,
            processes=found,
            source=str(obj.get("source") or "nvml"),
            error=obj.get("error") if isinstance(obj.get("error"), str) else None,
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed host map: {exc}") from exc


def _where(p: HostProcess) -> str:
    return "container" if p.container is not None else "host"


def merge_host_map(
    here: dict[int, HolderInfo],
    host_map: HostMap,
    run_pids: set[int] | frozenset[int],
    local_gpus: list[GpuInfo],
    now: float,
) -> list[HolderInfo]:
    """This container's fd holders made exact by the host's map; other containers' and the host's holders added.

    ``here``: pid -> holder from the /proc/*/fd scan (GPU indices from device nodes, not exact).
    """
    index_of = {g.uuid: g.index for g in local_gpus}
    foreign: dict[int, HolderInfo] = {}
    stale_mapping: dict[int, HolderInfo] = {}
    mapped: set[int] = set()
    for p in host_map.processes:
        gpu = index_of.get(p.gpu_uuid)
        if gpu is None:
            continue  # a GPU this container does not see: not part of its picture
        share = HolderGpu(gpu=gpu, used_mib=p.used_mib)
        if p.container == host_map.ctid and p.ns_pid is not None:
            h = _ours(here, p, now)
            if h is None:  # ended or reused since the host looked: never taken for the holder
                h = stale_mapping.setdefault(
                    p.ns_pid,
                    HolderInfo(pid=p.ns_pid, resolved=False, cmd=p.cmd, user=p.user, host_pid=p.host_pid),
                )
            else:
                mapped.add(h.pid)
            _add_share(h, share, "host-nvml")
            h.container, h.host_pid, h.context = host_map.ctid, p.host_pid, True
            h.source = "fd+host-nvml" if h.source.startswith("fd") else "host-nvml"
            continue
        if not p.exists:
            continue  # exited on the host since NVML listed it
        h = foreign.setdefault(
            p.host_pid,
            HolderInfo(
                pid=p.host_pid,
                resolved=False,
                user=p.user,
                cmd=p.cmd,
                source="host-nvml",
                context=True,
                scope=_where(p),
                container=p.container,
                host_pid=p.host_pid,
            ),
        )
        _add_share(h, share, "host-nvml")
    for pid, h in here.items():
        if pid in mapped:
            continue
        # Held a device node before the host looked and the host saw no context: a handle only (nvidia-smi, ...).
        if h.create_time is not None and h.create_time < host_map.t:
            h.context, h.gpus, h.gpus_source = False, [], None
    out = [*here.values(), *stale_mapping.values()]
    for h in out:
        h.in_run = h.pid in run_pids
    ours = sorted(out, key=lambda h: (not h.resolved, h.pid))
    return ours + sorted(foreign.values(), key=lambda h: (h.scope, h.container or "", h.pid))


def _ours(here: dict[int, HolderInfo], p: HostProcess, now: float) -> HolderInfo | None:
    """The process here that the host's PID maps to, when it is still the same one (same start tick)."""
    assert p.ns_pid is not None
    st = procs.read_stat(p.ns_pid)
    if st is None or (p.start_ticks is not None and st.start_ticks != p.start_ticks):
        return None
    h = here.get(p.ns_pid)
    if h is None:  # holds the GPU but we cannot read its fds (another user's): the host's word is enough
        h = procs.holder_of(p.ns_pid, st, now)
        h.source = "host-nvml"
        here[p.ns_pid] = h
    if h.gpus_source == "fd-scan":
        h.gpus = []  # the fd scan's every-GPU guess gives way to the host's exact list
    return h


def _add_share(h: HolderInfo, share: HolderGpu, source: str) -> None:
    if share.gpu not in h.gpus:
        h.gpus = sorted([*h.gpus, share.gpu])
        h.per_gpu = sorted([*h.per_gpu, share], key=lambda s: s.gpu)
    if share.used_mib is not None:
        h.used_mib = (h.used_mib or 0.0) + share.used_mib
    h.gpus_source = source
