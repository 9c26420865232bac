"""Which GPU a holder uses comes from NVML's per-GPU process lists, not from the /dev/nvidiaN descriptors it holds.

Measured on a 2xH200: a process that allocated 20 GiB on GPU 1 only held /dev/nvidia0 and /dev/nvidia1 (every CUDA
process opens every GPU's node), so the fd scan listed it on both GPUs and its stale-holder anomaly named GPU 0.
Recorded NVML answers (a stand-in pynvml module) play the driver; real sleepers hold stand-in device nodes.
"""

from __future__ import annotations

import io
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support.waiting import wait_until

from engine import protocol
from engine.agent import anomalies
from engine.agent.monitor_cmds import monitor_of
from engine.agent.server import Agent
from engine.host import holders, procs
from engine.host.gpus import NvmlGpus
from engine.protocol import HolderGpu, HolderInfo
from engine.supervisor import kill_stale

GIB = 1024**3
NO_SUCH_PID = 2**22 + 1  # above the kernel's largest pid_max: a host PID this namespace cannot see


class RecordedNvml:
    """NVML as recorded on a 2-GPU host: ``lists[i]`` is GPU i's compute process list as (pid, bytes) pairs."""

    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self, lists: list[list[tuple[int, int]]], used_bytes: list[int] | None = None) -> None:
        self.lists = lists
        self.used = used_bytes or [sum(b for _, b in procs_on) + 512 * 1024**2 for procs_on in lists]

    def nvmlInit(self) -> None: ...

    def nvmlShutdown(self) -> None: ...

    def nvmlDeviceGetCount(self) -> int:
        return len(self.lists)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return "NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-recorded-{h}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=100 if self.lists[h] else 0)

    def nvmlDeviceGetMemoryInfo(self, h: int, version: Any = None) -> Any:
        return SimpleNamespace(used=self.used[h], total=143771 * 1024**2)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 40

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 300_000

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        return 1980

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in self.lists[h]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[Any]:
        return []


@pytest.fixture
def dev_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "dev"
    d.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (d / name).write_bytes(b"")
    monkeypatch.setenv("SPECDEC_DEV_DIR", str(d))
    return d


@pytest.fixture
def cuda_like(dev_dir: Path) -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Start sleepers that hold every GPU node, as a CUDA process does whichever GPU it allocates on."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        fds = [os.open(dev_dir / n, os.O_RDONLY) for n in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm")]
        try:
            p = subprocess.Popen(["sleep", "60"], pass_fds=fds, stdin=subprocess.DEVNULL)
        finally:
            for fd in fds:
                os.close(fd)
        started.append(p)
        wait_until(lambda: p.pid in procs.scan_device_holders(str(dev_dir)), 10, "the sleeper's descriptors")
        return p

    yield start
    for p in started:
        p.kill()
        p.wait()


def holders_from(nv: RecordedNvml, dev_dir: Path, run_pids: set[int] | None = None) -> dict[int, HolderInfo]:
    sample = NvmlGpus(nv).sample()
    found = holders.find_holders(str(dev_dir), holders.NvmlView.of_sample(sample, "nvml", None), run_pids or set())
    return {h.pid: h for h in found}


def test_a_process_that_allocated_on_gpu1_only_holds_gpu1_only(dev_dir: Path, cuda_like) -> None:
    p = cuda_like()
    nv = RecordedNvml([[], [(p.pid, 20 * GIB)]])
    h = holders_from(nv, dev_dir)[p.pid]
    assert h.gpus == [1] and h.gpus_source == "nvml"
    assert h.per_gpu == [HolderGpu(gpu=1, used_mib=20480.0)]
    assert h.resolved and h.context is True


def test_its_stale_holder_anomaly_names_gpu1_not_gpu0(dev_dir: Path, cuda_like) -> None:
    p = cuda_like()
    nv = RecordedNvml([[], [(p.pid, 20 * GIB)]])
    sample = NvmlGpus(nv).sample()
    items = anomalies.gpu_anomalies(sample.gpus, list(holders_from(nv, dev_dir).values()), set(), run_active=False)
    stale = [a for a in items if a.kind == "stale_holder"]
    assert [(a.gpu, a.pid) for a in stale] == [(1, p.pid)]
    assert "holds GPU 1 (20480 MiB)" in stale[0].message and "GPU 0" not in stale[0].message


def test_two_processes_on_two_gpus_each_get_their_own_gpu_and_memory(dev_dir: Path, cuda_like) -> None:
    a, b = cuda_like(), cuda_like()
    nv = RecordedNvml([[(a.pid, 30 * GIB)], [(b.pid, 10 * GIB), (a.pid, 1 * GIB)]])
    found = holders_from(nv, dev_dir, run_pids={a.pid})
    assert found[a.pid].gpus == [0, 1] and found[a.pid].used_mib == 31 * 1024.0
    assert found[a.pid].per_gpu == [HolderGpu(0, 30 * 1024.0), HolderGpu(1, 1024.0)]
    assert found[b.pid].gpus == [1] and found[b.pid].per_gpu == [HolderGpu(1, 10 * 1024.0)]
    assert found[a.pid].in_run and not found[b.pid].in_run


def test_in_a_container_nvml_pids_do_not_resolve_and_the_fd_scan_is_labelled(dev_dir: Path, cuda_like) -> None:
    p = cuda_like()
    nv = RecordedNvml([[], [(NO_SUCH_PID, 20 * GIB)]])  # the host PID of our own process, seen from inside
    found = holders_from(nv, dev_dir)
    mine = found[p.pid]
    assert mine.gpus == [0, 1] and mine.gpus_source == "fd-scan" and mine.context is None
    host = found[NO_SUCH_PID]
    assert not host.resolved and host.gpus == [1] and host.gpus_source == "nvml"
    sample = NvmlGpus(nv).sample()
    stale = [a for a in anomalies.gpu_anomalies(sample.gpus, list(found.values()), set(), False) if a.pid == p.pid]
    assert len(stale) == 1 and stale[0].gpu is None
    assert "GPU unknown (fd scan" in stale[0].message and "/dev/nvidia0, /dev/nvidia1" in stale[0].message


def test_an_empty_complete_list_on_the_host_means_no_context_anywhere(
    dev_dir: Path, cuda_like, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(procs, "in_initial_pid_namespace", lambda: True)
    p = cuda_like()  # e.g. a script that opened the devices and freed its context
    h = holders_from(RecordedNvml([[], []]), dev_dir)[p.pid]
    assert h.context is False and h.gpus == [] and h.gpus_source is None


def test_an_empty_list_inside_a_container_proves_nothing(
    dev_dir: Path, cuda_like, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(procs, "in_initial_pid_namespace", lambda: False)
    p = cuda_like()
    h = holders_from(RecordedNvml([[], []]), dev_dir)[p.pid]
    assert h.context is None and h.gpus == [0, 1] and h.gpus_source == "fd-scan"


def test_status_json_says_where_holder_gpus_come_from(dev_dir: Path, cuda_like, tmp_path: Path) -> None:
    p = cuda_like()
    agent = Agent(run_root=tmp_path / "root", handlers={}, out=io.BytesIO())  # the monitor is called directly
    mon = monitor_of(agent)
    mon.gpu_source = NvmlGpus(RecordedNvml([[], [(p.pid, 20 * GIB)]]))
    status = protocol.to_jsonable(mon.status())
    assert status["holders_source"]["source"] == "nvml"
    assert status["host_map"] is None  # no --pct: no host view asked for
    (mine,) = [h for h in status["processes"]["holders"] if h["pid"] == p.pid]
    assert mine["gpus"] == [1] and mine["gpus_source"] == "nvml"
    assert mine["per_gpu"] == [{"gpu": 1, "used_mib": 20480.0}]
    mon.gpu_source = NvmlGpus(RecordedNvml([[], [(NO_SUCH_PID, 20 * GIB)]]))
    status = protocol.to_jsonable(mon.status())
    assert status["holders_source"]["source"] == "fd-scan"
    assert "do not resolve" in status["holders_source"]["detail"]


def test_kill_stale_candidates_carry_nvml_gpus(dev_dir: Path, cuda_like, tmp_path: Path) -> None:
    p = cuda_like()
    sample = NvmlGpus(RecordedNvml([[], [(p.pid, 20 * GIB)]])).sample()
    view = holders.NvmlView(
        sample.pid_used_mib, sample.pid_gpus, "nvml", pid_gpu_mib=sample.pid_gpu_mib, listed=True, gpus=sample.gpus
    )
    res = kill_stale.kill_stale(tmp_path / "root", dry_run=True, nvml=view)
    (cand,) = [h for h in res["candidates"] if h.pid == p.pid]
    assert cand.gpus == [1] and cand.gpus_source == "nvml"
    assert p.poll() is None  # a dry run signals nothing
