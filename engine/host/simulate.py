"""A simulated GPU source for demos and tests (``--simulate-gpus N``), labelled simulated everywhere.

Default behaviour: while a run is alive (``busy_pid``) every GPU is busy with varying utilization,
memory ramping up and the run's pid as holder; otherwise idle. Overrides script the anomalous states:

* phantom utilization: ``{"gpu": 3, "util_pct": 100, "mem_used_mib": 0, "holder_pid": null}``
* orphan memory:       ``{"gpu": 5, "util_pct": 0, "mem_used_mib": 40000, "holder_pid": null}``
* stale holder:        ``{"gpu": 1, "mem_used_mib": 20000, "holder_pid": <a pid not in the run>}``
* back to default:     ``{"gpu": 1, "reset": true}`` (``gpu`` omitted: every GPU)

Overrides come from the ``sim`` command or from a JSON file named by ``SPECDEC_SIM_SCRIPT`` (a list
of such objects), re-read whenever the file changes.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
import time
from typing import Any

from engine.host.gpus import GpuSample
from engine.protocol import MAX_SIMULATED_GPUS, GpuInfo

ENV_SIM_SCRIPT = "SPECDEC_SIM_SCRIPT"
SIM_MEM_TOTAL_MIB = 143771.0  # what an H200 reports
SIM_NAME = "Simulated H200"
_OVERRIDE_KEYS = ("util_pct", "mem_used_mib", "holder_pid")
_RAMP_S = 20.0  # memory ramp after a run starts
_BUSY_MEM_FRACTION = 0.62


class SimError(ValueError):
    """A sim instruction that cannot be applied (bad GPU index, bad value)."""


class SimulatedGpus:
    source = "simulated"
    error: str | None = None

    def __init__(self, count: int, script_path: str | None = None, seed: int | None = None) -> None:
        if not 0 < count <= MAX_SIMULATED_GPUS:
            raise SimError(f"simulated GPU count must be 1..{MAX_SIMULATED_GPUS}")
        self.count = count
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._overrides: list[dict[str, Any]] = [{} for _ in range(count)]
        self._script_overrides: list[dict[str, Any]] = [{} for _ in range(count)]
        self._busy_since: dict[int, float] = {}  # busy pid -> monotonic time it was first seen
        self._t0 = time.monotonic()
        self._script_path = script_path if script_path is not None else os.environ.get(ENV_SIM_SCRIPT)
        self._script_mtime: float | None = None
        self.script_error: str | None = None
        self._reload_script()

    # -- scripting -----------------------------------------------------------------------------

    def apply(self, instruction: dict[str, Any]) -> list[int]:
        """Apply one sim instruction (the ``sim`` command's args); returns the GPUs it touched."""
        with self._lock:
            return self._apply(instruction, self._overrides)

    def _apply(self, instruction: dict[str, Any], table: list[dict[str, Any]]) -> list[int]:
        gpu = instruction.get("gpu")
        if gpu is None:
            targets = list(range(self.count))
        elif isinstance(gpu, list):
            targets = [self._index(g) for g in gpu]
        else:
            targets = [self._index(gpu)]
        if instruction.get("reset"):
            for i in targets:
                table[i] = {}
            return targets
        values: dict[str, Any] = {}
        for key in _OVERRIDE_KEYS:
            if key not in instruction:
                continue
            v = instruction[key]
            if key == "holder_pid":
                if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                    raise SimError(f"holder_pid must be a positive integer or null, got {v!r}")
            elif not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise SimError(f"{key} must be a non-negative number, got {v!r}")
            elif key == "util_pct" and v > 100:
                raise SimError(f"util_pct must be at most 100, got {v!r}")
            elif key == "mem_used_mib" and v > SIM_MEM_TOTAL_MIB:
                raise SimError(f"mem_used_mib must be at most {SIM_MEM_TOTAL_MIB:.0f}, got {v!r}")
            values[key] = v
        if not values:
            raise SimError(f"nothing to set: give one of {', '.join(_OVERRIDE_KEYS)} or reset")
        for i in targets:
            table[i] = {**table[i], **values}
        return targets

    def _index(self, gpu: Any) -> int:
        if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < self.count:
            raise SimError(f"gpu must be an index in 0..{self.count - 1}, got {gpu!r}")
        return gpu

    def _reload_script(self) -> None:
        """Re-read the SPECDEC_SIM_SCRIPT file when its mtime changed; a bad file is a visible error."""
        path = self._script_path
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime_ns / 1e9
        except OSError:
            if self._script_mtime is not None:  # file removed: drop its overrides
                self._script_overrides = [{} for _ in range(self.count)]
                self._script_mtime = None
            return
        if mtime == self._script_mtime:
            return
        self._script_mtime = mtime
        table: list[dict[str, Any]] = [{} for _ in range(self.count)]
        try:
            with open(path, encoding="utf-8") as fh:
                items = json.load(fh)
            if isinstance(items, dict):
                items = [items]
            if not isinstance(items, list):
                raise SimError("the script must be a JSON list of sim instructions")
            for item in items:
                if not isinstance(item, dict):
                    raise SimError(f"a sim instruction must be an object, got {item!r}")
                self._apply(item, table)
        except (OSError, ValueError) as exc:
            self.script_error = f"{path}: {exc}"
            return
        self.script_error = None
        self._script_overrides = table

    # -- sampling ------------------------------------------------------------------------------

    def sample(self, busy_pid: int | None = None) -> GpuSample:
        with self._lock:
            self._reload_script()
            now_m = time.monotonic()
            if busy_pid is not None:
                self._busy_since.setdefault(busy_pid, now_m)
            for pid in list(self._busy_since):
                if pid != busy_pid:
                    del self._busy_since[pid]
            gpus: list[GpuInfo] = []
            pid_gpu_mib: dict[int, dict[int, float | None]] = {}
            for i in range(self.count):
                gpu = self._one(i, busy_pid, now_m)
                gpus.append(gpu)
                for pid in gpu.holder_pids:
                    pid_gpu_mib.setdefault(pid, {})[i] = gpu.mem_used_mib or 0.0
            return GpuSample(
                t=time.time(),
                gpus=gpus,
                pid_gpu_mib=pid_gpu_mib,
                processes_listed=True,
            )

    def _one(self, i: int, busy_pid: int | None, now_m: float) -> GpuInfo:
        ov = {**self._script_overrides[i], **self._overrides[i]}
        t = now_m - self._t0
        if busy_pid is not None:
            ramp = min(1.0, (now_m - self._busy_since[busy_pid]) / _RAMP_S)
            wave = 12.0 * math.sin(t / 6.0 + i * 0.9) + 5.0 * math.sin(t * 1.7 + i)
            util = 83.0 + wave + self._rng.uniform(-4.0, 4.0)
            util = max(0.0, min(100.0, util * ramp))
            mem = SIM_MEM_TOTAL_MIB * _BUSY_MEM_FRACTION * ramp + 350.0 * math.sin(t / 3.0 + i)
            holder: int | None = busy_pid
        else:
            util = max(0.0, self._rng.uniform(-2.0, 2.0))
            mem = 0.0
            holder = None
        if "util_pct" in ov:
            util = float(ov["util_pct"])
        if "mem_used_mib" in ov:
            mem = float(ov["mem_used_mib"])
        if "holder_pid" in ov:
            holder = ov["holder_pid"]
        mem = max(0.0, min(SIM_MEM_TOTAL_MIB, mem))
        return GpuInfo(
            index=i,
            name=SIM_NAME,
            uuid=f"GPU-00000000-5131-4d00-0000-{i:012d}",
            util_pct=round(util, 1),
            mem_used_mib=round(mem, 1),
            mem_total_mib=SIM_MEM_TOTAL_MIB,
            temp_c=round(32.0 + 0.45 * util + self._rng.uniform(-0.5, 0.5), 1),
            power_w=round(75.0 + 6.1 * util + self._rng.uniform(-5.0, 5.0), 1),
            sm_clock_mhz=1980.0 if util > 5 else 345.0,
            mem_clock_mhz=3201.0 if util > 5 or mem > 0 else 1593.0,
            holder_pids=[holder] if holder is not None else [],
            simulated=True,
        )

    def describe(self) -> list[dict[str, Any]]:
        """The overrides in force, per GPU (command and script merged)."""
        with self._lock:
            return [{"gpu": i, **self._script_overrides[i], **self._overrides[i]} for i in range(self.count)]
