"""GPU samples from NVML (nvidia-ml-py's ``pynvml``, the host's or the bundle's copy), initialised once per agent.

Each (GPU, field) call is tried once; a call that answers NOT_SUPPORTED is marked unsupported and
never made again (btop does the same). No NVML or no driver is a normal state with a reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol

from engine.host.capabilities import nvml_error_text
from engine.host.nvml_binding import BindingMissing, load_pynvml
from engine.protocol import GpuInfo

MIB = 1024 * 1024

# Field names as GpuInfo spells them; "processes" is the compute + graphics process list.
NVML_FIELDS: tuple[str, ...] = (
    "util_pct",
    "memory",
    "temp_c",
    "power_w",
    "sm_clock_mhz",
    "mem_clock_mhz",
    "processes",
)


@dataclass
class GpuSample:
    """One sample of every GPU plus the processes NVML saw on them."""

    t: float
    gpus: list[GpuInfo]
    # pid -> {GPU index: MiB on that GPU | None when NVML does not say}: NVML's per-GPU process lists
    pid_gpu_mib: dict[int, dict[int, float | None]] = field(default_factory=dict)
    # True when every GPU's process list was read: an empty list then means "no process", not "unknown"
    processes_listed: bool = False

    @property
    def pid_gpus(self) -> dict[int, list[int]]:
        """pid -> the GPU indices NVML lists it on."""
        return {pid: sorted(per_gpu) for pid, per_gpu in self.pid_gpu_mib.items()}

    @property
    def pid_used_mib(self) -> dict[int, float]:
        """pid -> MiB summed over its GPUs (0 where NVML does not say)."""
        return {pid: sum(m for m in per_gpu.values() if m is not None) for pid, per_gpu in self.pid_gpu_mib.items()}


class GpuSource(Protocol):
    source: str  # "nvml" | "simulated" | "none"
    error: str | None  # why there are no GPUs (no driver, no library)

    def sample(self, busy_pid: int | None = None) -> GpuSample: ...


class NoGpus:
    """No NVIDIA GPU visible: a normal state, reported with the reason."""

    source = "none"

    def __init__(self, error: str) -> None:
        self.error: str | None = error

    def sample(self, busy_pid: int | None = None) -> GpuSample:
        return GpuSample(t=time.time(), gpus=[])


def _is_not_supported(nvml: Any, exc: BaseException) -> bool:
    return getattr(exc, "value", None) == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


class NvmlGpus:
    """NVML sampler. ``nvmlInit`` once in the constructor; ``sample`` is thread-safe."""

    source = "nvml"

    def __init__(self, nvml: ModuleType | Any | None = None) -> None:
        self.error: str | None = None
        self._lock = threading.Lock()
        self._memory_v2: bool | None = None  # None: not tried yet
        self._nvml: Any = nvml
        self._handles: list[Any] = []
        self._names: list[str] = []
        self._uuids: list[str] = []
        self.unsupported: list[set[str]] = []
        self.last_errors: dict[tuple[int, str], str] = {}  # transient failures of the last sample
        self.binding: str | None = None  # which pynvml: the host's or the bundle's (nvml_binding)
        if self._nvml is None:
            try:
                found = load_pynvml()
            except BindingMissing as exc:
                self.error = str(exc)
                return
            self._nvml, self.binding = found.module, found.origin
        try:
            self._nvml.nvmlInit()
        except Exception as exc:  # NVMLError subclasses are generated at runtime
            self.error = nvml_error_text(exc)
            return
        try:
            count = int(self._nvml.nvmlDeviceGetCount())
            for i in range(count):
                h = self._nvml.nvmlDeviceGetHandleByIndex(i)
                self._handles.append(h)
                self._names.append(self._static(h, self._nvml.nvmlDeviceGetName, f"GPU {i}"))
                self._uuids.append(self._static(h, self._nvml.nvmlDeviceGetUUID, f"unknown-{i}"))
                self.unsupported.append(set())
        except Exception as exc:
            self.error = nvml_error_text(exc)
            self._handles = []

    @staticmethod
    def _static(handle: Any, fn: Callable[[Any], Any], fallback: str) -> str:
        try:
            return _text(fn(handle))
        except Exception:
            return fallback

    @property
    def ok(self) -> bool:
        return self.error is None

    def _call(self, index: int, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """One NVML call for one field; NOT_SUPPORTED marks the field for good, other errors this sample."""
        if name in self.unsupported[index]:
            return None
        try:
            return fn(*args)
        except Exception as exc:
            if _is_not_supported(self._nvml, exc):
                self.unsupported[index].add(name)
            else:
                self.last_errors[(index, name)] = f"{type(exc).__name__}: {exc}"
            return None

    def sample(self, busy_pid: int | None = None) -> GpuSample:
        nv = self._nvml
        with self._lock:
            self.last_errors = {}
            out: list[GpuInfo] = []
            pid_gpu_mib: dict[int, dict[int, float | None]] = {}
            listed = bool(self._handles)
            for i, h in enumerate(self._handles):
                rates = self._call(i, "util_pct", nv.nvmlDeviceGetUtilizationRates, h)
                util = rates.gpu if rates is not None else None
                mem = self._call(i, "memory", self._memory, h)
                temp = self._call(i, "temp_c", nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)
                power_mw = self._call(i, "power_w", nv.nvmlDeviceGetPowerUsage, h)
                sm = self._call(i, "sm_clock_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)
                mclk = self._call(i, "mem_clock_mhz", nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_MEM)
                procs = self._call(i, "processes", self._processes, h)
                listed = listed and procs is not None
                holders: list[int] = []
                for pid, used_bytes in procs or []:
                    holders.append(pid)
                    pid_gpu_mib.setdefault(pid, {})[i] = used_bytes / MIB if used_bytes is not None else None
                out.append(
                    GpuInfo(
                        index=i,
                        name=self._names[i],
                        uuid=self._uuids[i],
                        util_pct=float(util) if util is not None else None,
                        mem_used_mib=mem.used / MIB if mem is not None else None,
                        mem_total_mib=mem.total / MIB if mem is not None else None,
                        temp_c=float(temp) if temp is not None else None,
                        power_w=power_mw / 1000.0 if power_mw is not None else None,
                        sm_clock_mhz=float(sm) if sm is not None else None,
                        mem_clock_mhz=float(mclk) if mclk is not None else None,
                        holder_pids=sorted(set(holders)),
                        unsupported=sorted(self.unsupported[i]),
                    )
                )
            return GpuSample(
                t=time.time(),
                gpus=out,
                pid_gpu_mib=pid_gpu_mib,
                processes_listed=listed,
            )

    def _memory(self, handle: Any) -> Any:
        """Memory info v2 where the binding and driver have it: its `used` leaves out the driver's reserved
        memory, as nvidia-smi does (v1 counted ~600 MiB more on an H200 with driver 580)."""
        nv = self._nvml
        if self._memory_v2 is not False and hasattr(nv, "nvmlMemory_v2"):
            try:
                info = nv.nvmlDeviceGetMemoryInfo(handle, version=nv.nvmlMemory_v2)
            except Exception as exc:  # older driver or binding: v1 from now on, said once in unsupported
                if (
                    _is_not_supported(nv, exc)
                    or isinstance(exc, (TypeError, AttributeError))
                    or "Function" in type(exc).__name__
                ):
                    self._memory_v2 = False
                else:
                    raise
            else:
                self._memory_v2 = True
                return info
        return nv.nvmlDeviceGetMemoryInfo(handle)

    def _processes(self, handle: Any) -> list[tuple[int, int | None]]:
        """(pid, used bytes | None) of compute and graphics processes; graphics may be unsupported alone."""
        nv = self._nvml
        found: dict[int, int | None] = {}
        for p in nv.nvmlDeviceGetComputeRunningProcesses(handle):
            found[int(p.pid)] = _used_bytes(p)
        try:
            graphics = nv.nvmlDeviceGetGraphicsRunningProcesses(handle)
        except Exception as exc:
            if not _is_not_supported(nv, exc):
                raise
            graphics = []
        for p in graphics:
            found.setdefault(int(p.pid), _used_bytes(p))
        return sorted(found.items())

    def close(self) -> None:
        if self._handles or self.error is None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:  # shutting down: nothing left to report to
                return


def _used_bytes(p: Any) -> int | None:
    used = getattr(p, "usedGpuMemory", None)
    # NVML reports "not available" (e.g. under MIG or without privileges) as None or a huge sentinel.
    if used is None or used >= 2**63:
        return None
    return int(used)
