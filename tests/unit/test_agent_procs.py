"""GPU holders through /proc/*/fd (real processes holding stand-in device nodes), NVML merging, trees, identity."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
from support.waiting import wait_until

from engine.host import holders, procs

NO_SUCH_PID = 2**22 + 1  # above the kernel's largest pid_max: never a live process


def after_boot(create_time: float) -> float:
    """Seconds from boot to a create time of ours: the part no wall-clock step moves (btime is wall time)."""
    return create_time - procs.boot_time()


def psutil_after_boot(pid: int) -> float:
    """psutil's view of the same: its create time less its boot time, both read now. Comparing wall times
    instead fails whenever the clock steps between our cached btime and psutil's fresh one (17 s once)."""
    return psutil.Process(pid).create_time() - psutil.boot_time()


@pytest.fixture
def dev_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "dev"
    d.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia7", "nvidiactl", "nvidia-uvm"):
        (d / name).write_bytes(b"")
    monkeypatch.setenv("SPECDEC_DEV_DIR", str(d))
    return d


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []

    def start(*nodes: Path, argv: list[str] | None = None) -> subprocess.Popen[bytes]:
        fds = [os.open(n, os.O_RDONLY) for n in nodes]
        try:
            p = subprocess.Popen(argv or ["sleep", "60"], pass_fds=fds, stdin=subprocess.DEVNULL)
        finally:
            for fd in fds:
                os.close(fd)
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def holders_by_pid(
    dev_dir: str | None = None, run_pids: frozenset[int] | set[int] = frozenset(), **view: object
) -> dict[int, procs.HolderInfo]:
    """find_holders with the GPU source's view given field by field (pid_used_mib=..., source=...)."""
    found = holders.find_holders(dev_dir, holders.NvmlView(**view), run_pids)  # type: ignore[arg-type]
    return {h.pid: h for h in found}


def test_fd_holders_are_found_with_their_gpu_indices(
    dev_dir: Path, spawn: Callable[..., subprocess.Popen[bytes]]
) -> None:
    a = spawn(dev_dir / "nvidia0", dev_dir / "nvidiactl", dev_dir / "nvidia-uvm")
    b = spawn(dev_dir / "nvidia1", dev_dir / "nvidia7")
    ctl_only = spawn(dev_dir / "nvidiactl")
    bystander = spawn()
    wait_until(lambda: {a.pid, b.pid, ctl_only.pid} <= set(holders_by_pid()), 10, "holders visible")
    found = holders_by_pid()
    assert bystander.pid not in found
    assert found[a.pid].gpus == [0]
    assert found[b.pid].gpus == [1, 7]
    assert found[ctl_only.pid].gpus == []
    h = found[a.pid]
    assert h.resolved and h.source == "fd" and not h.in_run
    assert h.cmd == "sleep 60"
    assert h.user == pwd.getpwuid(os.getuid()).pw_name
    assert h.state == "sleeping"
    assert h.age_s is not None and 0 <= h.age_s < 60
    assert after_boot(h.create_time) == pytest.approx(psutil_after_boot(a.pid), abs=0.02)


def test_default_dev_dir_comes_from_the_environment(
    dev_dir: Path, spawn: Callable[..., subprocess.Popen[bytes]]
) -> None:
    p = spawn(dev_dir / "nvidia1")
    assert procs.default_dev_dir() == str(dev_dir)
    wait_until(lambda: p.pid in holders_by_pid(), 10, "holder")
    assert p.pid not in holders_by_pid(dev_dir=str(dev_dir / "elsewhere"))


def test_nvml_pid_that_does_not_exist_here_is_unresolved_not_an_error(dev_dir: Path) -> None:
    found = holders_by_pid(pid_used_mib={NO_SUCH_PID: 1234.0}, pid_gpus={NO_SUCH_PID: [3]})
    h = found[NO_SUCH_PID]
    assert not h.resolved
    assert h.used_mib == 1234.0 and h.gpus == [3] and h.source == "nvml"
    assert h.cmd is None and h.create_time is None


def test_nvml_pid_naming_an_unrelated_local_process_is_unresolved(
    dev_dir: Path, spawn: Callable[..., subprocess.Popen[bytes]]
) -> None:
    # A host PID from NVML that happens to exist in this namespace as some other process holding no GPU.
    other = spawn()
    found = holders_by_pid(pid_used_mib={other.pid: 500.0})
    assert not found[other.pid].resolved


def test_nvml_and_fd_views_merge(dev_dir: Path, spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    p = spawn(dev_dir / "nvidia0")
    wait_until(lambda: p.pid in holders_by_pid(), 10, "holder")
    h = holders_by_pid(pid_used_mib={p.pid: 2048.0}, pid_gpus={p.pid: [0, 1]}, run_pids={p.pid})[p.pid]
    assert h.resolved and h.source == "fd+nvml"
    assert h.used_mib == 2048.0 and h.gpus == [0, 1] and h.in_run


def test_simulated_source_resolves_by_existence(dev_dir: Path, spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    p = spawn()
    found = holders_by_pid(pid_used_mib={p.pid: 100.0, NO_SUCH_PID: 5.0}, source="simulated")
    assert found[p.pid].resolved and found[p.pid].source == "simulated"
    assert not found[NO_SUCH_PID].resolved


def test_identity_changes_with_the_process_and_vanishes_with_it(spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    p = spawn()
    ident = procs.proc_identity(p.pid)
    assert ident is not None and ident[0] == p.pid
    assert after_boot(ident[1]) == pytest.approx(psutil_after_boot(p.pid), abs=0.02)
    assert procs.same_process(p.pid, ident[1])
    assert procs.same_process(p.pid, float(json.loads(json.dumps(ident[1]))))  # through the wire, exactly
    assert not procs.same_process(p.pid, ident[1] - 10.0)
    # One clock tick apart is another process (a PID reused a tick later), not float noise.
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    assert not procs.same_process(p.pid, ident[1] - tick) and not procs.same_process(p.pid, ident[1] + tick)
    p.kill()
    p.wait()
    assert procs.proc_identity(p.pid) is None
    assert not procs.same_process(p.pid, ident[1])
    assert procs.proc_identity(NO_SUCH_PID) is None


def test_zombie_state_is_reported() -> None:
    child = subprocess.Popen(["true"])
    try:
        wait_until(lambda: (st := procs.read_stat(child.pid)) is not None and st.state == "Z", 10, "zombie")
        st = procs.read_stat(child.pid)
        assert st is not None and procs.state_name(st.state) == "zombie"
    finally:
        child.wait()


def test_process_tree_with_threads_cpu_and_rss(spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    code = (
        "import threading, time, subprocess\n"
        "ev = threading.Event()\n"
        "for i in range(3): threading.Thread(target=ev.wait, daemon=True).start()\n"
        "kid = subprocess.Popen(['sleep', '60'])\n"
        "end = time.time() + 60\n"
        "while time.time() < end: pass\n"
    )
    root = spawn(argv=[sys.executable, "-c", code])
    wait_until(lambda: len(procs.process_tree(root.pid)) == 2, 10, "child in tree")
    tracker = procs.CpuTracker()
    tree = procs.process_tree(root.pid, tracker)
    assert tree[0].pid == root.pid
    top, kid = tree
    assert kid.ppid == root.pid and kid.cmd == "sleep 60"
    assert len(top.threads) >= 4
    assert top.threads[0].tid == root.pid
    assert all(t.name for t in top.threads)
    assert top.rss_mib is not None and top.rss_mib > 1
    assert after_boot(top.create_time) == pytest.approx(psutil_after_boot(root.pid), abs=0.02)

    wait_until(lambda: (procs.process_tree(root.pid, tracker)[0].cpu_pct or 0.0) > 5.0, 10, "cpu% of a busy loop")
    assert procs.process_tree(NO_SUCH_PID) == []


def test_tree_includes_reparented_members_of_the_process_group(spawn: Callable[..., subprocess.Popen[bytes]]) -> None:
    # setsid makes the shell a group leader; the backgrounded sleep is orphaned (reparented) when the shell exits.
    leader = subprocess.Popen(
        ["setsid", "sh", "-c", 'sh -c "sleep 60 & echo \\$!"; exec sleep 60'], stdout=subprocess.PIPE
    )
    try:
        assert leader.stdout is not None
        orphan = int(leader.stdout.readline())

        def reparented() -> bool:
            st = procs.read_stat(orphan)
            parent = procs.read_stat(st.ppid) if st is not None else None
            return parent is None or parent.pgrp != leader.pid

        wait_until(reparented, 10, "the intermediate shell to exit")
        st = procs.read_stat(orphan)
        assert st is not None and st.pgrp == leader.pid
        assert orphan in procs.tree_pids(leader.pid)
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()
