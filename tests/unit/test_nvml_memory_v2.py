"""Memory used as nvidia-smi reports it: NVML's v2 memory info (driver's reserved memory left out), with a
fallback to v1 on a binding or driver without it. Measured on the H200: v1 read 615 MiB above nvidia-smi."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from test_agent_gpus import RecordingNvml  # same folder: pytest puts it on sys.path

from engine.host.gpus import NvmlGpus

MIB = 1024 * 1024


class NvmlWithV2(RecordingNvml):
    nvmlMemory_v2 = 0x02000028

    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Any:  # type: ignore[override]
        self._n("mem")
        if version == self.nvmlMemory_v2:
            return SimpleNamespace(used=1000 * MIB, reserved=615 * MIB, total=143771 * MIB)
        return SimpleNamespace(used=1615 * MIB, total=143771 * MIB)


class NvmlV2Missing(NvmlWithV2):
    def nvmlDeviceGetMemoryInfo(self, h: int, version: int | None = None) -> Any:  # type: ignore[override]
        if version is not None:
            raise type("NVMLError_FunctionNotFound", (Exception,), {})("Function Not Found")
        return super().nvmlDeviceGetMemoryInfo(h)


def test_v2_memory_info_is_used_when_the_binding_has_it() -> None:
    s = NvmlGpus(NvmlWithV2(gpus=1)).sample()
    assert s.gpus[0].mem_used_mib == 1000.0


def test_without_v2_the_v1_figure_is_used_and_v2_not_asked_again() -> None:
    nv = NvmlV2Missing(gpus=1)
    src = NvmlGpus(nv)
    first, second = src.sample(), src.sample()
    assert first.gpus[0].mem_used_mib == second.gpus[0].mem_used_mib == 1615.0
    assert src._memory_v2 is False
