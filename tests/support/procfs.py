"""Processes and cgroups as the kernel shows them (/proc, the cgroup v2 tree), read independently of the code
under test."""

from __future__ import annotations

from pathlib import Path

from support.waiting import wait_until

CGROUP_RELEASE_S = 5.0  # the kernel frees an emptied cgroup soon after its last member was reaped


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child nobody reaped yet is not alive)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return False
    return raw[raw.rindex(b")") + 2 :].split()[0] not in (b"Z", b"X")


def cgroup2_root() -> Path | None:
    """Where a cgroup v2 hierarchy is mounted (the unified one of a hybrid setup counts), or None."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def _rmdir(d: Path) -> bool:
    try:
        d.rmdir()
    except OSError:  # EBUSY until the kernel has released the last exited member
        return False
    return True


def remove_cgroup_tree(top: Path, timeout_s: float = CGROUP_RELEASE_S) -> None:
    """Remove a cgroup directory and every child cgroup under it, deepest first, each within ``timeout_s``."""
    deepest_first = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for d in [*deepest_first, top]:
        wait_until(lambda d=d: _rmdir(d), timeout_s, f"cgroup {d} to be released", interval_s=0.01)
