"""What this host can do for the agent: NVML, psutil, watchfiles, tmux, py-spy, each with a reason.

Stdlib only at import; the optional modules are imported inside the probes (pynvml through
engine.host.nvml_binding, which falls back to the copy shipped in the bundle).
"""

from __future__ import annotations

import importlib
import shutil
from typing import Any

from engine.host.nvml_binding import BindingMissing, load_pynvml

Capability = dict[str, Any]  # {"ok": bool, "detail": str}


def nvml_error_text(exc: BaseException) -> str:
    """A sentence for an NVML init failure, naming the library when it is simply not there."""
    name = type(exc).__name__
    if "LibraryNotFound" in name:
        return "libnvidia-ml.so.1 not found (no NVIDIA driver on this host or in this container)"
    if "DriverNotLoaded" in name:
        return "NVIDIA driver not loaded"
    if "NoPermission" in name:
        return "no permission to talk to the NVIDIA driver"
    return f"{name}: {exc}"


def nvml_fix_text(exc: BaseException) -> str:
    """What to do about an NVML failure, for the cause it has (doctor's fix line)."""
    name = type(exc).__name__
    if isinstance(exc, BindingMissing):
        return (
            "the agent bundle is incomplete (it ships nvidia-ml-py's pynvml.py): reinstall specdec-tui on the "
            "client with nvidia-ml-py present, or pip install nvidia-ml-py on the host"
        )
    if "LibraryNotFound" in name:
        return (
            "install the NVIDIA driver (it provides libnvidia-ml.so.1) or, in a container, expose it "
            "(docker --gpus all / nvidia-container-toolkit; for LXC bind-mount the driver libraries)"
        )
    if "DriverNotLoaded" in name:
        return "load the NVIDIA kernel module (modprobe nvidia, or reboot after a driver install); check nvidia-smi"
    if "NoPermission" in name:
        return "give this user access to /dev/nvidia* (device permissions, or the container's device list)"
    if "Mismatch" in name:
        return "the driver library and kernel module versions differ (a driver upgrade without reboot): reboot"
    return "run nvidia-smi on the host: it reports the driver's own error"


def probe_nvml() -> Capability:
    """NVML init and device count; ``binding`` says which pynvml answered, ``fix`` what to do when not ok."""
    try:
        binding = load_pynvml()
    except BindingMissing as exc:
        return {"ok": False, "detail": str(exc), "binding": None, "fix": nvml_fix_text(exc)}
    pynvml = binding.module
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # pynvml raises NVMLError subclasses built at runtime
        return {"ok": False, "detail": nvml_error_text(exc), "binding": binding.origin, "fix": nvml_fix_text(exc)}
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
        if isinstance(driver, bytes):
            driver = driver.decode()
        return {"ok": True, "detail": f"{count} GPU(s), driver {driver}", "binding": binding.origin, "fix": ""}
    except Exception as exc:
        return {"ok": False, "detail": nvml_error_text(exc), "binding": binding.origin, "fix": nvml_fix_text(exc)}
    finally:
        pynvml.nvmlShutdown()  # init is reference-counted; the sampler keeps its own


def _probe_module(name: str, install_hint: str) -> Capability:
    try:
        mod = importlib.import_module(name)
    except ImportError as exc:
        return {"ok": False, "detail": f"not installed ({exc}); {install_hint}"}
    version = getattr(mod, "__version__", None) or getattr(mod, "VERSION", None) or "unknown version"
    return {"ok": True, "detail": f"{name} {version}"}


def _probe_program(name: str, install_hint: str) -> Capability:
    path = shutil.which(name)
    if path is None:
        return {"ok": False, "detail": f"{name} not on PATH; {install_hint}"}
    return {"ok": True, "detail": path}


def probe_capabilities() -> dict[str, Capability]:
    """Every optional capability with ok and a one-line reason. Never raises."""
    return {
        "nvml": probe_nvml(),
        "psutil": _probe_module("psutil", "process data falls back to /proc"),
        "watchfiles": _probe_module("watchfiles", "log follow polls stat instead"),
        "tmux": _probe_program("tmux", "runs start with setsid and cannot be attached"),
        "py_spy": _probe_program("py-spy", "stacks come from faulthandler (SIGUSR1) instead"),
    }
