"""GPU sources: NVML probing discipline (init once, NOT_SUPPORTED never retried), no-driver state, simulation."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.host.gpu_source import open_gpu_source
from engine.host.gpus import NoGpus, NvmlGpus
from engine.host.simulate import SimError, SimulatedGpus

NOT_SUPPORTED = 3
GPU_IS_LOST = 15


class NvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"nvml error {value}")
        self.value = value


class RecordingNvml:
    """Stands in for the NVML C library (none on this CI machine): counts calls, fails some fields."""

    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2

    def __init__(self, gpus: int = 2) -> None:
        self.calls: Counter[str] = Counter()
        self.gpus = gpus
        self.lost_once = True

    def _n(self, name: str) -> None:
        self.calls[name] += 1

    def nvmlInit(self) -> None:
        self._n("init")

    def nvmlShutdown(self) -> None:
        self._n("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        self._n("util")
        return SimpleNamespace(gpu=42 + h)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        self._n("mem")
        return SimpleNamespace(used=1024 * 1024 * 1024 * (h + 1), total=1024 * 1024 * 143771)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        self._n("temp")
        return 40

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        self._n("power")
        if h == 1:
            raise NvmlError(NOT_SUPPORTED)  # e.g. a board without power readout
        return 350_000

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        self._n(f"clock{clock}")
        if clock == self.NVML_CLOCK_MEM and self.lost_once:
            self.lost_once = False
            raise NvmlError(GPU_IS_LOST)  # transient: retried next sample
        return 1980

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        self._n("procs")
        if h == 0:
            return [SimpleNamespace(pid=4242, usedGpuMemory=2 * 1024**3), SimpleNamespace(pid=5151, usedGpuMemory=None)]
        return [SimpleNamespace(pid=4242, usedGpuMemory=1024**3)]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list[Any]:
        raise NvmlError(NOT_SUPPORTED)


def test_nvml_initialised_once_and_unsupported_fields_not_retried() -> None:
    nv = RecordingNvml()
    src = NvmlGpus(nv)
    assert src.ok and src.source == "nvml"
    samples = [src.sample() for _ in range(5)]
    assert nv.calls["init"] == 1
    assert nv.calls["power"] == 5 + 1  # GPU 0 every sample; GPU 1 once: it said NOT_SUPPORTED
    src.sample()
    assert nv.calls["power"] == 7
    assert nv.calls["util"] == 12
    g0, g1 = samples[-1].gpus
    assert g0.power_w == 350.0 and g1.power_w is None
    assert g1.unsupported == ["power_w"] and g0.unsupported == []
    assert g0.util_pct == 42 and g1.util_pct == 43
    assert g0.mem_used_mib == 1024 and g0.mem_total_mib == 143771
    assert g0.name == "NVIDIA H200" and g0.uuid == "GPU-0"


def test_transient_nvml_error_is_retried_next_sample() -> None:
    nv = RecordingNvml(gpus=1)
    src = NvmlGpus(nv)
    first = src.sample()
    assert first.gpus[0].mem_clock_mhz is None and (0, "mem_clock_mhz") in src.last_errors
    second = src.sample()
    assert second.gpus[0].mem_clock_mhz == 1980 and second.gpus[0].unsupported == []


def test_nvml_process_list_is_merged_per_pid() -> None:
    src = NvmlGpus(RecordingNvml())
    s = src.sample()
    assert s.pid_gpus == {4242: [0, 1], 5151: [0]}
    assert s.pid_used_mib == {4242: 3072.0, 5151: 0.0}
    assert s.gpus[0].holder_pids == [4242, 5151]


def test_no_driver_is_a_normal_state_with_the_reason() -> None:
    class Missing(RecordingNvml):
        def nvmlInit(self) -> None:
            raise type("NVMLError_LibraryNotFound", (Exception,), {})("NVML Shared Library Not Found")

    src = NvmlGpus(Missing())
    assert not src.ok and src.error is not None and "libnvidia-ml.so.1 not found" in src.error
    assert src.sample().gpus == []


def test_open_gpu_source_on_this_machine_reports_plainly() -> None:
    src = open_gpu_source(0)
    assert src.source in ("nvml", "none")
    if isinstance(src, NoGpus):
        assert src.error and src.sample().gpus == []


def test_simulated_gpus_are_labelled_and_idle_without_a_run() -> None:
    sim = SimulatedGpus(8, script_path="", seed=1)
    s = sim.sample()
    assert len(s.gpus) == 8 and all(g.simulated for g in s.gpus)
    assert all("Simulated" in g.name for g in s.gpus)
    assert all(g.mem_used_mib == 0 and (g.util_pct or 0) <= 2 and g.holder_pids == [] for g in s.gpus)


def test_simulated_gpus_are_busy_while_a_run_is_alive() -> None:
    sim = SimulatedGpus(4, script_path="", seed=2)
    sim.sample(busy_pid=999)
    sim._busy_since[999] -= 60  # as if the run started a minute ago: the memory ramp is over
    s = sim.sample(busy_pid=999)
    assert all(g.holder_pids == [999] for g in s.gpus)
    assert all((g.util_pct or 0) > 50 and (g.mem_used_mib or 0) > 50_000 for g in s.gpus)
    assert s.pid_gpus == {999: [0, 1, 2, 3]}
    utils = {g.util_pct for g in s.gpus}
    assert len(utils) > 1  # varying, not a flat line


def test_sim_instructions_script_the_three_anomalous_states() -> None:
    sim = SimulatedGpus(8, script_path="", seed=3)
    sim.apply({"gpu": 3, "util_pct": 100, "mem_used_mib": 0, "holder_pid": None})
    sim.apply({"gpu": 5, "mem_used_mib": 40000})
    sim.apply({"gpu": 1, "mem_used_mib": 20000, "holder_pid": 4321})
    s = sim.sample()
    assert (s.gpus[3].util_pct, s.gpus[3].mem_used_mib, s.gpus[3].holder_pids) == (100, 0, [])
    assert (s.gpus[5].mem_used_mib, s.gpus[5].holder_pids) == (40000, [])
    assert s.gpus[1].holder_pids == [4321] and s.pid_used_mib == {4321: 20000}
    sim.apply({"gpu": 3, "reset": True})
    assert sim.sample().gpus[3].util_pct != 100
    sim.apply({"reset": True})
    assert all(d == {"gpu": i} for i, d in enumerate(sim.describe()))


@pytest.mark.parametrize(
    "bad",
    [{"gpu": 8, "util_pct": 1}, {"gpu": 0, "util_pct": 101}, {"gpu": 0, "holder_pid": -3}, {"gpu": 0}, {"gpu": "x"}],
)
def test_bad_sim_instructions_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(SimError):
        SimulatedGpus(8, script_path="").apply(bad)


def test_sim_script_file_from_the_environment_is_applied_and_reloaded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "sim.json"
    script.write_text(json.dumps([{"gpu": 2, "util_pct": 99, "mem_used_mib": 0}]))
    monkeypatch.setenv("SPECDEC_SIM_SCRIPT", str(script))
    sim = SimulatedGpus(4, seed=4)
    assert sim.sample().gpus[2].util_pct == 99
    script.write_text(json.dumps([{"gpu": 0, "mem_used_mib": 1234}]))
    st = script.stat()
    os.utime(script, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a visibly newer mtime
    s = sim.sample()
    assert s.gpus[0].mem_used_mib == 1234 and s.gpus[2].util_pct != 99
    script.write_text("not json")
    os.utime(script, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    sim.sample()
    assert sim.script_error is not None and "sim.json" in sim.script_error


def test_a_simulated_gpu_count_past_the_bound_is_refused_by_the_source_the_agent_and_the_client() -> None:
    """`--simulate-gpus 50000000` grew the agent to 7.5 GB at 100 % CPU until the client gave up after 30 s."""
    import subprocess
    import sys

    from engine.protocol import MAX_SIMULATED_GPUS

    assert SimulatedGpus(MAX_SIMULATED_GPUS).count == MAX_SIMULATED_GPUS
    with pytest.raises(SimError, match=f"must be 1..{MAX_SIMULATED_GPUS}"):
        SimulatedGpus(MAX_SIMULATED_GPUS + 1)
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    for cmd in (
        [sys.executable, "-m", "engine.agent.main", "--simulate-gpus", "50000000"],
        [sys.executable, "-m", "tui", "status", "local", "--simulate-gpus", "50000000"],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, stdin=subprocess.DEVNULL)
        assert done.returncode == 2, (cmd, done.stderr[-2000:])
        assert "Traceback" not in done.stderr and "50000000" in done.stderr.splitlines()[-1], done.stderr
