"""The ``kill-stale`` verb: our user's holders of an NVIDIA device outside the current run, listed or signalled.

Each holder is re-checked by (pid, create_time) before every signal; nothing is ever matched by name.
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path
from typing import Any

from engine import protocol
from engine.host import procs
from engine.host.agents import live_agents
from engine.host.holders import NvmlView, find_holders
from engine.supervisor import records
from engine.supervisor.common import KILL_WAIT_S, Progress, SupervisorError, noop, state_of, wait_until


def supervised_run_pids(run_root: Path | str, ended: set[str] | None = None, exclude: str | None = None) -> set[int]:
    """The processes of every run under ``run_root`` that has not ended (no exit record), the current one or not:
    a second launch makes itself current, and the first run's processes, still training, are not stale. What an
    ended run left behind is not protected here. ``ended``: records.unended_runs's cache. ``exclude``: a run id
    whose processes the caller has already (the process table is then read only when another run is going)."""
    dirs = [rd for rd in records.unended_runs(run_root, ended) if rd.name != exclude]
    if not dirs:
        return set()
    stats = procs.all_stats()
    out: set[int] = set()
    for rd in dirs:
        out |= records.run_pids(records.read_launch(rd), stats)
    return out


def _protected_pids() -> set[int]:
    """This agent and its ancestors: never candidates (the agent may hold /dev/nvidiactl for NVML)."""
    out: set[int] = set()
    pid = os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        st = procs.read_stat(pid)
        if st is None:
            break
        pid = st.ppid
    return out


def _foreign_owner(pid: int) -> str | None:
    """The owner's name when the process is not (wholly) ours, i.e. its real or effective uid is not our euid.

    kill-stale signals only the agent's own user's processes (as nvitop does): on a shared box, an agent
    running as root must not end a colleague's job that happens to hold a GPU.
    """
    uids = procs.uids_of(pid)
    me = os.geteuid()
    if uids is not None and uids[0] == me and uids[1] == me:
        return None
    return procs.user_of(pid) or (str(uids[0]) if uids is not None else "unknown (its status is unreadable)")


def _foreign_reason(owner: str) -> str:
    return f"owned by user {owner}; kill-stale only signals your own processes"


def _classify(
    run_root: Path | str, nvml: NvmlView | None
) -> tuple[list[protocol.HolderInfo], list[tuple[protocol.HolderInfo, str]]]:
    current = records.current_run_dir(run_root)
    ours = records.run_pids(records.read_launch(current)) if current is not None else set()
    going = supervised_run_pids(run_root, exclude=current.name if current is not None else None) - ours
    protected = _protected_pids()
    view = nvml or NvmlView()
    candidates: list[protocol.HolderInfo] = []
    others: list[tuple[protocol.HolderInfo, str]] = []
    found = find_holders(None, view, ours)
    agents = live_agents(run_root)
    for h in found:
        reason = _left_alone_reason(h, ours, protected, agents, going)
        if reason is None:
            candidates.append(h)
        else:
            others.append((h, reason))
    return candidates, others


def _left_alone_reason(
    h: protocol.HolderInfo,
    ours: set[int],
    protected: set[int],
    agents: set[int] | frozenset[int] = frozenset(),
    going: set[int] | frozenset[int] = frozenset(),
) -> str | None:
    """Why a holder is never a kill-stale candidate; None when it is one. ``going``: the processes of the run
    root's other runs that have not ended (supervised_run_pids)."""
    if h.scope != "here":
        where = f"container {h.container}" if h.scope == "container" else "the Proxmox host"
        return f"runs in {where} (host pid {h.host_pid}, seen from the host): never signalled from this container"
    if h.in_run or h.pid in ours:
        return "part of the current run"
    if h.pid in going:
        return "part of another supervised run that is still going (not the current one; `runs` lists it)"
    if not h.resolved:
        return "NVML reports this PID but it is not visible here (another PID namespace)"
    if h.pid in protected:
        return "this agent or its parent"
    owner = _foreign_owner(h.pid)
    if owner is not None:
        return _foreign_reason(owner)
    if h.context is False:
        return "holds a device handle but no GPU context (a monitor such as nvidia-smi or nvitop); frees nothing"
    return procs.by_design(h, agents)  # by what the process is (executable, recorded agent, context), not its name


def kill_stale(
    run_root: Path | str,
    dry_run: bool = True,
    targets: list[list[float]] | list[tuple[int, float]] | None = None,
    grace_s: float = 10.0,
    progress: Progress = noop,
    nvml: NvmlView | None = None,
) -> dict[str, Any]:
    """List (dry run) or signal the stale GPU holders, each by PID after re-checking (pid, create_time).

    Holders come from /proc/*/fd links to <dev>/nvidia* (what works inside a container) plus, when
    given, the GPU source's process list (NVML, or the simulated source under --simulate-gpus).
    """
    candidates, others = _classify(run_root, nvml)
    result: dict[str, Any] = {
        "candidates": candidates,
        "left_alone": [{"holder": h, "reason": reason} for h, reason in others],
        "signalled": [],
        "failed": [],
        "dry_run": dry_run,
    }
    if dry_run:
        return result
    by_pid = {h.pid: h for h in candidates}
    # Each chosen holder with the create time every later check compares against: the target's own, as listed.
    chosen: list[tuple[protocol.HolderInfo, float | None]] = []
    failed: list[dict[str, Any]] = result["failed"]
    if targets is None:
        chosen = [(h, h.create_time) for h in candidates]
    else:
        for item in targets:
            if (
                not isinstance(item, (list, tuple))
                or len(item) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in item)
            ):
                raise SupervisorError(f"targets must be [pid, create_time] number pairs; got {item!r}")
            pid, ct = int(item[0]), float(item[1])
            h = by_pid.get(pid)
            if h is not None and h.create_time is not None and _same_tick(h.create_time, ct):
                chosen.append((h, ct))
                continue
            failed.append({"pid": pid, "create_time": ct, "reason": _why_not_candidate(pid, ct, others)})
    pending: list[dict[str, Any]] = []
    for h, ct_listed in chosen:
        entry: dict[str, Any] = {
            "pid": h.pid,
            "create_time": ct_listed,
            "user": h.user,
            "cmd": h.cmd,
            "signals": [],
        }
        err = _signal_checked(h.pid, ct_listed, signal.SIGTERM)
        if err is not None:
            failed.append({**entry, "reason": err})
            progress(f"pid {h.pid}: not signalled: {err}")
            continue
        entry["signals"].append("SIGTERM")
        progress(f"SIGTERM to pid {h.pid} ({h.user}: {(h.cmd or '')[:80]})")
        pending.append(entry)
    t0 = time.monotonic()
    wait_until(lambda: all(not _same_alive(e["pid"], e["create_time"]) for e in pending), grace_s if pending else 0)
    for e in pending:
        if not _same_alive(e["pid"], e["create_time"]):
            e["outcome"] = f"exited {time.monotonic() - t0:.1f} s after SIGTERM"
            continue
        err = _signal_checked(e["pid"], e["create_time"], signal.SIGKILL)
        if err is not None:
            e["outcome"] = f"SIGKILL not sent: {err}"
            continue
        e["signals"].append("SIGKILL")
        progress(f"pid {e['pid']} still alive after {grace_s:g} s: SIGKILL")
    killed = [e for e in pending if "SIGKILL" in e["signals"]]
    wait_until(lambda: all(not _same_alive(e["pid"], e["create_time"]) for e in killed), KILL_WAIT_S if killed else 0)
    for e in pending:
        if "outcome" in e:
            continue
        if _same_alive(e["pid"], e["create_time"]):
            e["outcome"] = f"still alive {KILL_WAIT_S:g} s after SIGKILL (state {state_of(e['pid'])})"
            failed.append({**e, "reason": e["outcome"]})
        else:
            e["outcome"] = "killed by SIGKILL after the grace"
    result["signalled"] = pending
    for e in pending:
        progress(f"pid {e['pid']}: {e['outcome']}")
    return result


_HZ = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _same_tick(a: float, b: float) -> bool:
    """Two create times name the same start: /proc start times are whole clock ticks (1/SC_CLK_TCK, 10 ms), so
    anything beyond float noise (half a tick) is another start, e.g. a PID reused one tick later."""
    return abs(a - b) < 0.5 / _HZ


def _same_alive(pid: int, create_time: float | None) -> bool:
    if create_time is None:
        return False
    st = procs.read_stat(pid)
    if st is None or st.state in ("Z", "X", "x"):
        return False
    return _same_tick(procs.create_time_of(st), create_time)


def _signal_checked(pid: int, create_time: float | None, sig: int) -> str | None:
    """Send sig to pid only if it is still the listed process (same start tick) and ours; the reason when not."""
    if create_time is None or not procs.same_process(pid, create_time, 0.49 / _HZ):
        return "no longer the process that was listed (exited, or its PID was reused): not touched"
    owner = _foreign_owner(pid)
    if owner is not None:
        return f"not signalled: {_foreign_reason(owner)}"
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return "exited before the signal"
    except PermissionError:
        return f"permission denied (EPERM): owned by {procs.user_of(pid) or 'another user'}; run as that user or root"
    except OSError as exc:
        return f"{errno.errorcode.get(exc.errno or 0, 'error')}: {exc.strerror}"
    return None


def _why_not_candidate(pid: int, create_time: float, others: list[tuple[protocol.HolderInfo, str]]) -> str:
    ident = procs.proc_identity(pid)
    if ident is None:
        return "no such process (already exited)"
    if not _same_tick(ident[1], create_time):
        return "its PID now belongs to another process (create time differs): not touched"
    for h, reason in others:
        if h.pid == pid:
            return f"not a stale holder: {reason}"
    return "holds no NVIDIA device: never touched by kill-stale"
