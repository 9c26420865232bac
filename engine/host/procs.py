"""Processes from /proc: the one reader of the process table (stat, status, cmdline, threads, fds), identity.

Pure /proc and stdlib (works on a host without psutil). Identity is (pid, start ticks): the start time in
clock ticks after boot from /proc/<pid>/stat; as a wall time, create_time = boot time + start ticks / CLK_TCK,
the same formula psutil uses, so a PID reused by another process never passes for the one recorded.
"""

from __future__ import annotations

import os
import pwd
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.protocol import HolderInfo, ProcInfo, ThreadInfo

PROC = "/proc"
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_GPU_NODE = re.compile(r"nvidia(\d+)")
PROC_PID_INIT_INO = 0xEFFFFFFC  # the inode number of the kernel's initial PID namespace (include/linux/proc_ns.h)

# /proc/<pid>/stat state letters, named as psutil names them.
_STATES = {
    "R": "running",
    "S": "sleeping",
    "D": "disk-sleep",
    "Z": "zombie",
    "T": "stopped",
    "t": "tracing-stop",
    "X": "dead",
    "x": "dead",
    "I": "idle",
    "P": "parked",
    "W": "waking",
    "K": "wake-kill",
}

GONE_STATES = ("Z", "X", "x")  # zombie or dead: the process has ended, only its table entry may remain

# Driver daemons and monitors that hold /dev/nvidia* by design: holders, but never "stale" when the process is that
# installed program (procs.by_design checks its executable, not its name).
SYSTEM_HOLDER_NAMES: frozenset[str] = frozenset(
    {"nvidia-persistenced", "nv-hostengine", "nvidia-smi", "dcgm-exporter", "nvidia-powerd", "nvtop"}
)


def default_dev_dir() -> str:
    return os.environ.get("SPECDEC_DEV_DIR", "/dev")


@dataclass
class ProcStat:
    """The fields of /proc/<pid>/stat the agent uses."""

    pid: int
    comm: str
    state: str
    ppid: int
    pgrp: int
    session: int
    cpu_ticks: int  # utime + stime
    num_threads: int
    start_ticks: int
    rss_pages: int


_boot_time: float | None = None


def read_boot_id() -> str:
    """This boot's id: a run recorded under another one did not survive a reboot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def boot_time() -> float:
    """Unix time of the host's boot (/proc/stat btime)."""
    global _boot_time
    if _boot_time is None:
        with open(f"{PROC}/stat", "rb") as fh:
            for line in fh:
                if line.startswith(b"btime "):
                    _boot_time = float(line.split()[1])
                    break
            else:
                raise OSError("no btime in /proc/stat")
    return _boot_time


def read_stat(pid: int) -> ProcStat | None:
    """Parse /proc/<pid>/stat; None when the process is gone or unreadable."""
    try:
        with open(f"{PROC}/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    # comm may contain spaces and parentheses: it ends at the last ')'.
    lpar, rpar = raw.find(b"("), raw.rfind(b")")
    if lpar < 0 or rpar < 0:
        return None
    comm = raw[lpar + 1 : rpar].decode("utf-8", "replace")
    rest = raw[rpar + 2 :].split()
    try:
        return ProcStat(
            pid=pid,
            comm=comm,
            state=rest[0].decode(),
            ppid=int(rest[1]),
            pgrp=int(rest[2]),
            session=int(rest[3]),
            cpu_ticks=int(rest[11]) + int(rest[12]),
            num_threads=int(rest[17]),
            start_ticks=int(rest[19]),
            rss_pages=int(rest[21]),
        )
    except (IndexError, ValueError):
        return None


def create_time_of(st: ProcStat) -> float:
    return boot_time() + st.start_ticks / _CLK_TCK


def proc_identity(pid: int) -> tuple[int, float] | None:
    """(pid, create_time) of a live process, or None when there is no such process."""
    st = read_stat(pid)
    if st is None:
        return None
    return (pid, create_time_of(st))


def same_process(pid: int, create_time: float, tolerance_s: float | None = None) -> bool:
    """True when ``pid`` is still the process that had ``create_time`` (PID reuse guard).

    Start times are whole clock ticks after one boot time, so the same process always gives the same value:
    the default tolerance is half a tick (float noise only). A wider one would take a process that reused
    the PID within that window for the listed one (measured: 28 of 28 forced reuses within 50 ms passed 0.05 s).
    """
    ident = proc_identity(pid)
    tol = 0.5 / _CLK_TCK if tolerance_s is None else tolerance_s
    return ident is not None and abs(ident[1] - create_time) <= tol


def process_alive(pid: int | None, start_ticks: int | None) -> bool:
    """True when pid is alive (not a zombie) and, when start_ticks is known, is still the same process."""
    if not pid or pid <= 0:
        return False
    st = read_stat(pid)
    if st is None or st.state in GONE_STATES:
        return False
    return start_ticks is None or st.start_ticks == start_ticks


def start_ticks_of(pid: int) -> int | None:
    st = read_stat(pid)
    return st.start_ticks if st is not None else None


def state_name(letter: str) -> str:
    return _STATES.get(letter, letter)


def list_pids() -> list[int]:
    try:
        names = os.listdir(PROC)
    except OSError:
        return []
    return [int(n) for n in names if n.isdigit()]


_user_cache: dict[int, str] = {}


def uids_of(pid: int) -> tuple[int, int] | None:
    """(real, effective) uid of a process from /proc/<pid>/status; None when it cannot be read."""
    try:
        with open(f"{PROC}/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Uid:"):
                    fields = line.split()
                    return int(fields[1]), int(fields[2])
    except (OSError, ValueError, IndexError):
        return None
    return None


def user_of(pid: int) -> str | None:
    """The real user of a process, by name when the passwd database knows it."""
    uids = uids_of(pid)
    if uids is None:
        return None
    uid = uids[0]
    name = _user_cache.get(uid)
    if name is None:
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        _user_cache[uid] = name
    return name


def catches_signal(pid: int, sig: int) -> bool:
    """The process has a handler for ``sig`` (SigCgt in /proc/<pid>/status); False when unreadable."""
    try:
        with open(f"{PROC}/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError, IndexError):
        return False
    return False


def exe_name(pid: int) -> str:
    """The file name of the process's executable; "" when unreadable (another user's process, gone)."""
    try:
        return os.path.basename(os.readlink(f"{PROC}/{pid}/exe"))
    except OSError:
        return ""


def wait_channel(pid: int) -> str:
    """The kernel function the process sleeps in (/proc/<pid>/wchan); "" when running or unreadable."""
    try:
        wchan = Path(f"{PROC}/{pid}/wchan").read_text().strip()
    except OSError:
        return ""
    return "" if wchan == "0" else wchan


def environ_of(pid: int) -> list[bytes] | None:
    """The process's environment entries (NAME=value); None when unreadable."""
    try:
        return Path(f"{PROC}/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None


def memory_mib() -> dict[str, float]:
    """MemTotal and MemAvailable of the host in MiB (/proc/meminfo); {} when unreadable."""
    out: dict[str, float] = {}
    try:
        with open(f"{PROC}/meminfo", "rb") as fh:
            for line in fh:
                key, _, rest = line.partition(b":")
                if key in (b"MemTotal", b"MemAvailable"):
                    out[key.decode()] = int(rest.split()[0]) / 1024.0  # kB -> MiB
    except (OSError, ValueError, IndexError):
        return {}
    return out


ARGV_MAX_BYTES = 1 << 20  # the most of a command line read to compare it with a recorded one


def argv_of(pid: int) -> list[str] | None:
    """The process's argv as its /proc cmdline has it (bounded); None when unreadable or empty (a kernel thread,
    a zombie)."""
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as fh:
            raw = fh.read(ARGV_MAX_BYTES)
    except OSError:
        return None
    if not raw:
        return None
    return [p.decode("utf-8", "surrogateescape") for p in raw.removesuffix(b"\0").split(b"\0")]


def cmdline_of(pid: int, comm: str | None = None) -> str:
    """The command line joined with spaces; ``[comm]`` for kernel threads and zombies."""
    try:
        with open(f"{PROC}/{pid}/cmdline", "rb") as fh:
            raw = fh.read()
    except OSError:
        raw = b""
    parts = [p.decode("utf-8", "replace") for p in raw.rstrip(b"\0").split(b"\0") if p]
    if parts:
        return " ".join(parts)
    if comm is None:
        st = read_stat(pid)
        comm = st.comm if st is not None else "?"
    return f"[{comm}]"


def threads_of(pid: int) -> list[ThreadInfo]:
    """Every thread of a process with its name (/proc/<pid>/task/<tid>/comm)."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"{PROC}/{pid}/task") if t.isdigit())
    except OSError:
        return []
    out: list[ThreadInfo] = []
    for tid in tids:
        try:
            with open(f"{PROC}/{pid}/task/{tid}/comm", "rb") as fh:
                name = fh.read().rstrip(b"\n").decode("utf-8", "replace")
        except OSError:
            continue  # the thread ended between listdir and open
        out.append(ThreadInfo(tid=tid, name=name))
    return out


def fd_target(pid: int, fd: int) -> str | None:
    """What a process's descriptor ``fd`` names (a path, ``pipe:[...]``, ``socket:[...]``); None when unreadable."""
    try:
        return os.readlink(f"{PROC}/{pid}/fd/{fd}")
    except OSError:
        return None


def nvidia_fds(pid: int, dev_dir: str) -> tuple[bool, set[str]] | None:
    """Names of the <dev_dir>/nvidia* nodes a process holds open.

    Returns None when the fd table cannot be read (gone, or another user's process without
    privileges), else (True, {"nvidia0", "nvidiactl", ...}) (the set may be empty).
    """
    fd_dir = f"{PROC}/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError:
        return None
    prefix = dev_dir.rstrip("/") + "/nvidia"
    names: set[str] = set()
    for fd in fds:
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
        except OSError:
            continue
        if target.startswith(prefix):
            names.add(target[len(dev_dir.rstrip("/")) + 1 :])
    return (True, names)


def scan_device_holders(dev_dir: str | None = None, pids: Iterable[int] | None = None) -> dict[int, set[str]]:
    """pid -> names of the nvidia* nodes it holds, for every process whose fds we can read."""
    dev = dev_dir if dev_dir is not None else default_dev_dir()
    found: dict[int, set[str]] = {}
    for pid in pids if pids is not None else list_pids():
        res = nvidia_fds(pid, dev)
        if res is not None and res[1]:
            found[pid] = res[1]
    return found


def gpu_indices(node_names: Iterable[str]) -> list[int]:
    """GPU indices from device node names: nvidia3 -> 3; nvidiactl and nvidia-uvm name no GPU."""
    out = set()
    for name in node_names:
        m = _GPU_NODE.fullmatch(name)
        if m:
            out.add(int(m.group(1)))
    return sorted(out)


def holder_of(pid: int, st: ProcStat, now: float) -> HolderInfo:
    """A resolved holder record of a live process (its identity, owner, command, state, age)."""
    ct = create_time_of(st)
    return HolderInfo(
        pid=pid,
        resolved=True,
        create_time=ct,
        user=user_of(pid),
        cmd=cmdline_of(pid, st.comm),
        state=state_name(st.state),
        age_s=max(0.0, now - ct),
    )


def in_initial_pid_namespace() -> bool:
    """True in the kernel's first PID namespace (a host, not a container): its inode number is fixed."""
    try:
        return os.stat(f"{PROC}/self/ns/pid").st_ino == PROC_PID_INIT_INO
    except OSError:
        return False


SYSTEM_PREFIXES = ("/usr/", "/bin/", "/sbin/")


def exe_path(pid: int) -> str | None:
    """The real path of the process's executable; None when unreadable (another user's process, gone)."""
    try:
        return os.readlink(f"{PROC}/{pid}/exe")
    except OSError:
        return None


def system_binary(path: str) -> bool:
    """``path`` is an installed system program: under /usr, /bin or /sbin, owned by root and writable by nobody
    else, in a directory owned by root and writable by nobody else. A job cannot make one of its own (unless it
    runs as root), so naming itself ``nvidia-smi`` gains it nothing."""
    if not path.startswith(SYSTEM_PREFIXES):
        return False
    for item in (path, os.path.dirname(path)):
        try:
            st = os.stat(item)
        except OSError:
            return False
        if st.st_uid != 0 or st.st_mode & 0o022:
            return False
    return True


def holds_cuda_context(pid: int, dev_dir: str | None = None) -> bool:
    """The process has <dev>/nvidia-uvm open, as every process with a CUDA context does (NVML alone never
    opens it): it may hold GPU memory, whatever it is called."""
    found = nvidia_fds(pid, dev_dir if dev_dir is not None else default_dev_dir())
    return found is not None and "nvidia-uvm" in found[1]


def by_design(
    h: HolderInfo, agents: set[int] | frozenset[int] = frozenset(), programs: frozenset[str] = SYSTEM_HOLDER_NAMES
) -> str | None:
    """Why ``h`` holds an NVIDIA device by design (this agent; another specdec agent, as it recorded itself; a
    driver daemon or monitor whose executable is that installed system program, one of ``programs``), None when
    nothing says so.

    Decided by what the process is first: a holder with a GPU context (NVML lists it, or it has /dev/nvidia-uvm
    open) holds GPU memory and is never one of these, whatever its name. Only a holder with no GPU context, which
    frees no GPU memory when killed (so a name gains a stale job nothing), is also taken for a specdec agent by its
    command line: an agent of another run root never recorded itself in ``agents``."""
    if h.pid == os.getpid():
        return "this agent"
    if h.context is True or holds_cuda_context(h.pid):
        return None
    if h.pid in agents:
        return "a specdec agent (recorded at its start; it holds the device for NVML, no GPU context)"
    if h.cmd and ("engine.agent.main" in h.cmd or os.path.basename(h.cmd.split(" ")[0]) == "specdec-agent"):
        return "a specdec agent by its command line (no GPU context: it holds the device for NVML, no memory)"
    exe = exe_path(h.pid)
    if exe is not None and os.path.basename(exe) in programs and system_binary(exe):
        return f"a driver daemon or monitor ({exe}) that holds the device by design"
    return None


def is_system_holder(h: HolderInfo, agents: set[int] | frozenset[int] = frozenset()) -> bool:
    """``by_design`` as a yes or no: kept out of the stale-holder anomaly and never a kill-stale candidate."""
    return by_design(h, agents) is not None


class CpuTracker:
    """CPU percent per process between two calls, keyed by identity (a reused PID starts afresh).

    The first time a process is seen its average since start is reported.
    """

    def __init__(self) -> None:
        self._last: dict[tuple[int, int], tuple[int, float]] = {}

    def percent(self, st: ProcStat) -> float:
        key = (st.pid, st.start_ticks)
        now = time.monotonic()
        prev = self._last.get(key)
        self._last[key] = (st.cpu_ticks, now)
        if prev is None:
            age_s = time.time() - create_time_of(st)
            return 100.0 * (st.cpu_ticks / _CLK_TCK) / age_s if age_s > 0 else 0.0
        dt = now - prev[1]
        if dt <= 0:
            return 0.0
        return 100.0 * ((st.cpu_ticks - prev[0]) / _CLK_TCK) / dt


_default_tracker = CpuTracker()


def all_stats() -> dict[int, ProcStat]:
    out: dict[int, ProcStat] = {}
    for pid in list_pids():
        st = read_stat(pid)
        if st is not None:
            out[pid] = st
    return out


def tree_pids(root_pid: int, stats: dict[int, ProcStat] | None = None) -> list[int]:
    """The root and its descendants (by ppid), plus members of the root's process group when it
    leads one (children that a double fork reparented to init). Empty when the root is gone."""
    table = stats if stats is not None else all_stats()
    root = table.get(root_pid)
    if root is None:
        return []
    children: dict[int, list[int]] = {}
    for st in table.values():
        children.setdefault(st.ppid, []).append(st.pid)
    seen = {root_pid}
    order = [root_pid]
    queue = [root_pid]
    while queue:
        pid = queue.pop()
        for child in sorted(children.get(pid, [])):
            if child not in seen:
                seen.add(child)
                order.append(child)
                queue.append(child)
    if root.pgrp == root_pid:
        for st in sorted(table.values(), key=lambda s: s.pid):
            if st.pgrp == root_pid and st.pid not in seen:
                seen.add(st.pid)
                order.append(st.pid)
    return order


def group_members(pgid: int, table: dict[int, ProcStat] | None = None, min_start_ticks: int | None = None) -> list[int]:
    """Live (non-zombie) members of a process group that started no earlier than ``min_start_ticks``."""
    stats = table if table is not None else all_stats()
    return [
        st.pid
        for st in stats.values()
        if st.pgrp == pgid
        and st.state not in GONE_STATES
        and (min_start_ticks is None or st.start_ticks >= min_start_ticks)
    ]


def proc_info(st: ProcStat, tracker: CpuTracker | None = None, with_threads: bool = True) -> ProcInfo:
    trk = tracker if tracker is not None else _default_tracker
    return ProcInfo(
        pid=st.pid,
        ppid=st.ppid,
        user=user_of(st.pid),
        cmd=cmdline_of(st.pid, st.comm),
        cpu_pct=round(trk.percent(st), 1),
        rss_mib=round(st.rss_pages * _PAGE_SIZE / (1024 * 1024), 1),
        create_time=create_time_of(st),
        state=state_name(st.state),
        threads=threads_of(st.pid) if with_threads else [],
    )


def process_tree(root_pid: int, tracker: CpuTracker | None = None, with_threads: bool = True) -> list[ProcInfo]:
    """The run's process tree, root first, each process with its threads, CPU% and RSS."""
    stats = all_stats()
    out: list[ProcInfo] = []
    for pid in tree_pids(root_pid, stats):
        st = stats.get(pid)
        if st is not None:
            out.append(proc_info(st, tracker, with_threads))
    return out
