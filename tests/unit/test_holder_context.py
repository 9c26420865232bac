"""A process that holds /dev/nvidia* but has no GPU context (nvidia-smi, nvitop, a script that only opened
NVML) is neither a stale-holder anomaly nor a kill-stale candidate, once NVML's process list is shown to be
in our PID namespace. Seen on the H200: the device-check script itself was flagged stale before this."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.agent import anomalies
from engine.host.holders import NvmlView, find_holders
from engine.protocol import GpuInfo
from engine.supervisor import kill_stale


@pytest.fixture
def dev_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "dev"
    d.mkdir()
    for name in ("nvidia0", "nvidiactl"):
        (d / name).write_bytes(b"")
    monkeypatch.setenv("SPECDEC_DEV_DIR", str(d))
    return d


@pytest.fixture
def holders(dev_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """(compute, monitor): two sleepers holding nvidia0 + nvidiactl; NVML will list only the first."""
    fds = [os.open(dev_dir / n, os.O_RDONLY) for n in ("nvidia0", "nvidiactl")]
    try:
        compute = subprocess.Popen(["sleep", "60"], pass_fds=fds)
        monitor = subprocess.Popen(["sleep", "60"], pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    yield compute, monitor
    for p in (compute, monitor):
        p.kill()
        p.wait()


def _gpu() -> GpuInfo:
    return GpuInfo(index=0, name="H200", uuid="GPU-0", util_pct=100.0, mem_used_mib=9000.0, mem_total_mib=143771.0)


def test_holder_missing_from_nvml_list_has_no_context_and_is_not_stale(holders, dev_dir: Path) -> None:
    compute, monitor = holders
    found = {h.pid: h for h in find_holders(str(dev_dir), NvmlView(pid_used_mib={compute.pid: 8192.0}))}
    assert found[compute.pid].context is True
    assert found[monitor.pid].context is False
    stale = [a.pid for a in anomalies.gpu_anomalies([_gpu()], list(found.values()), set(), False)]
    assert stale == [compute.pid]


def test_without_nvml_every_fd_holder_stays_a_candidate(holders, dev_dir: Path) -> None:
    compute, monitor = holders
    found = {h.pid: h for h in find_holders(str(dev_dir), NvmlView())}
    assert found[compute.pid].context is None and found[monitor.pid].context is None
    stale = {a.pid for a in anomalies.gpu_anomalies([_gpu()], list(found.values()), set(), False)}
    assert stale == {compute.pid, monitor.pid}


def test_an_unresolvable_nvml_pid_means_another_namespace_so_nothing_is_called_a_monitor(holders, dev_dir) -> None:
    compute, monitor = holders
    unseen = 2**22 + 1  # above pid_max: NVML's host PID that this namespace cannot see
    found = {h.pid: h for h in find_holders(str(dev_dir), NvmlView(pid_used_mib={unseen: 8192.0}))}
    assert found[unseen].resolved is False
    assert found[compute.pid].context is None and found[monitor.pid].context is None


def test_kill_stale_leaves_a_monitor_alone_and_says_why(holders, dev_dir: Path, tmp_path: Path) -> None:
    compute, monitor = holders
    view = NvmlView(pid_used_mib={compute.pid: 8192.0}, pid_gpus={compute.pid: [0]}, source="nvml")
    res = kill_stale.kill_stale(tmp_path / "runs-root", dry_run=True, nvml=view)
    assert [h.pid for h in res["candidates"]] == [compute.pid]
    left = {entry["holder"].pid: entry for entry in res["left_alone"]}
    assert monitor.pid in left, res
    assert "no GPU context" in left[monitor.pid]["reason"]
    assert compute.poll() is None and monitor.poll() is None  # a dry run signals nothing


def test_the_scanning_process_never_lists_itself_though_it_holds_the_device(holders, dev_dir: Path) -> None:
    # The agent opens /dev/nvidia* for NVML and has no context: it is the monitor the H200 pane called stale.
    compute, monitor = holders
    own = os.open(dev_dir / "nvidiactl", os.O_RDONLY)
    try:
        for view in (NvmlView(), NvmlView(pid_used_mib={compute.pid: 8192.0})):
            pids = {h.pid for h in find_holders(str(dev_dir), view)}
            assert os.getpid() not in pids and {compute.pid, monitor.pid} <= pids
        res = kill_stale.kill_stale(dev_dir.parent / "runs-root", dry_run=True, nvml=NvmlView())
        assert os.getpid() not in {h.pid for h in res["candidates"]}
        assert os.getpid() not in {entry["holder"].pid for entry in res["left_alone"]}
    finally:
        os.close(own)
