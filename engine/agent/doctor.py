"""Host checks for ``doctor``: each with ok, a detail, and how to fix it.

torch is imported in a child interpreter with a timeout, never in the agent (the agent must stay
torch-free and responsive; a broken CUDA install can hang an import).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from engine.agent.anomalies import gpu_anomalies
from engine.host.capabilities import probe_nvml
from engine.protocol import Anomaly

NVIDIA_DEVICE_NODE = "/dev/nvidiactl"  # there on every machine (and container) an NVIDIA driver serves
MIN_FREE_GIB = 5.0
TORCH_PROBE_TIMEOUT_S = 60.0
MIN_PYTHON = (3, 10)

_TORCH_PROBE = """
import json, sys
out = {"torch": None, "cuda": None, "devices": 0, "cuda_version": None, "error": None}
try:
    import torch
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
else:
    out["torch"] = torch.__version__
    out["cuda_version"] = torch.version.cuda
    try:
        out["cuda"] = bool(torch.cuda.is_available())
        out["devices"] = torch.cuda.device_count() if out["cuda"] else 0
    except Exception as exc:
        out["cuda"] = False
        out["error"] = f"{type(exc).__name__}: {exc}"
sys.stdout.write(json.dumps(out))
"""


def check(name: str, ok: bool, detail: str, fix: str = "", level: str | None = None) -> dict[str, Any]:
    """One check; ``level`` is "ok", "warn" or "fail" (a warn is ok=False that does not block training)."""
    return {
        "name": name,
        "ok": ok,
        "detail": detail,
        "fix": "" if ok else fix,
        "level": level or ("ok" if ok else "fail"),
    }


def probe_torch(python: str | None = None, timeout_s: float = TORCH_PROBE_TIMEOUT_S) -> dict[str, Any]:
    """torch version and CUDA availability, from a child interpreter (a hang becomes a timeout)."""
    exe = python or sys.executable
    try:
        proc = subprocess.run(
            [exe, "-c", _TORCH_PROBE],
            capture_output=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {"torch": None, "cuda": None, "error": f"importing torch took over {timeout_s:.0f} s"}
    except OSError as exc:
        return {"torch": None, "cuda": None, "error": f"cannot run {exe}: {exc}"}
    try:
        res: dict[str, Any] = json.loads(proc.stdout.decode("utf-8", "replace"))
    except ValueError:
        tail = proc.stderr.decode("utf-8", "replace").strip().splitlines()[-3:]
        return {"torch": None, "cuda": None, "error": f"probe exited {proc.returncode}: {' | '.join(tail)}"}
    return res


def disk_check(run_root: Path, min_free_gib: float = MIN_FREE_GIB) -> dict[str, Any]:
    probe = run_root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the run root may not exist yet: measure the filesystem it will live on
    try:
        usage = shutil.disk_usage(probe)
    except OSError as exc:
        return check("disk", False, f"cannot measure {probe}: {exc}", "check the --run-root path")
    free_gib = usage.free / 1024**3
    detail = f"{free_gib:.1f} GiB free of {usage.total / 1024**3:.0f} GiB at {probe}"
    if free_gib < min_free_gib:
        return check(
            "disk",
            False,
            detail,
            f"free space below {min_free_gib:.0f} GiB: checkpoints will fail; delete old runs under "
            f"{run_root / 'runs'} or use --run-root on a larger disk",
            level="warn",
        )
    return check("disk", True, detail)


def writable_check(run_root: Path) -> dict[str, Any]:
    try:
        run_root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_root, prefix=".doctor-", delete=True) as fh:
            fh.write(b"ok")
            fh.flush()
    except OSError as exc:
        return check(
            "run_root",
            False,
            f"{run_root} is not writable: {exc}",
            f"create it with the right owner (mkdir -p {run_root}) or pass --run-root DIR",
        )
    return check("run_root", True, f"{run_root} is writable")


def stale_check(stale: list[Anomaly]) -> dict[str, Any]:
    if not stale:
        return check("stale_gpu_holders", True, "no process outside the current run holds a GPU")
    pids = ", ".join(str(a.pid) for a in stale if a.pid is not None)
    return check(
        "stale_gpu_holders",
        False,
        "; ".join(a.message for a in stale),
        f"stop them with `specdec-tui kill-stale TARGET --dry-run` then `--yes` (pids {pids})",
        level="warn",
    )


def gpu_present() -> bool:
    return Path(NVIDIA_DEVICE_NODE).exists()


def not_present(name: str, what: str) -> dict[str, Any]:
    """A GPU check on a machine with no NVIDIA driver that nobody expects one on: said, not failed."""
    return check(
        name,
        True,
        f"not present: {what} (no {NVIDIA_DEVICE_NODE}; a CPU-only machine); --expect-gpu makes this a failure",
    )


def run_doctor(
    run_root: Path,
    gpu_state: tuple[str, str | None, list[Any], list[Any], set[int], bool],
    python: str | None = None,
    expect_gpu: bool = False,
) -> list[dict[str, Any]]:
    """All checks. ``gpu_state``: (source, error, gpus, holders, run_pids, run_active) from the monitor.
    Without ``expect_gpu``, CUDA and NVML on a machine without an NVIDIA driver say "not present" and pass."""
    checks: list[dict[str, Any]] = []
    cpu_only = not expect_gpu and not gpu_present()
    v = sys.version_info
    py_ok = (v.major, v.minor) >= MIN_PYTHON
    checks.append(
        check(
            "python",
            py_ok,
            f"{sys.executable} {v.major}.{v.minor}.{v.micro}",
            f"install Python >= {MIN_PYTHON[0]}.{MIN_PYTHON[1]} and pass --python PATH",
        )
    )
    torch = probe_torch(python)
    if torch.get("torch"):
        checks.append(check("torch", True, f"torch {torch['torch']} (CUDA build {torch.get('cuda_version')})"))
        if torch.get("cuda"):
            checks.append(check("cuda", True, f"{torch.get('devices')} CUDA device(s) visible to torch"))
        elif cpu_only:
            checks.append(not_present("cuda", f"torch {torch['torch']} runs on the CPU here"))
        else:
            why = torch.get("error") or (
                "torch is a CPU-only build" if not torch.get("cuda_version") else "no CUDA device visible"
            )
            checks.append(
                check(
                    "cuda",
                    False,
                    f"torch.cuda.is_available() is False: {why}",
                    "install a CUDA build of torch matching the driver, check CUDA_VISIBLE_DEVICES and nvidia-smi",
                )
            )
    else:
        checks.append(
            check(
                "torch",
                False,
                f"torch not importable: {torch.get('error')}",
                "pip install torch (needed to train; monitoring works without it)",
            )
        )
        checks.append(check("cuda", False, "unknown: torch is not importable", "install torch first"))
    source, _error, gpus, holders, run_pids, run_active = gpu_state
    if source == "simulated":
        checks.append(check("nvml", True, f"simulated GPUs ({len(gpus)}); real NVML not consulted"))
    else:
        nv = probe_nvml()
        binding = f" (pynvml: {nv['binding']})" if nv.get("binding") else ""
        if not nv["ok"] and cpu_only:
            checks.append(not_present("nvml", "no NVIDIA GPU data"))
        else:
            checks.append(check("nvml", nv["ok"], f"{nv['detail']}{binding}", nv.get("fix") or ""))
    tmux = shutil.which("tmux")
    checks.append(
        check(
            "tmux",
            tmux is not None,
            tmux or "tmux not on PATH: runs start with setsid and cannot be attached",
            "apt-get install tmux (or your package manager's equivalent)",
            level=None if tmux else "warn",
        )
    )
    checks.append(disk_check(run_root))
    checks.append(writable_check(run_root))
    stale = [a for a in gpu_anomalies(gpus, holders, run_pids, run_active) if a.kind == "stale_holder"]
    checks.append(stale_check(stale))
    return checks
