"""The Triton a GPU host's torch ships, installed without its dependencies into a cached directory put on a
subprocess's path beside this interpreter's torch (CPU builds of torch carry no Triton).

torch 2.11, on the lent GPU hosts, requires ``triton==3.6.0``. The wheel brings its own ptxas, so the kernels
compile to an sm_90 cubin here without a GPU; ``TRITON_INTERPRET=1`` runs them on CPU tensors. Cached under
~/.cache/specdec-tui/ with a ``.ready`` file; a lock keeps two test processes from installing it together.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from speculators_venv import RegistryUnreachable  # beside this file: the interop checks' one "cannot run here"

TRITON_VERSION = "3.6.0"
PIP_TIMEOUT_S = 600


def site_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specdec-tui" / f"triton-{TRITON_VERSION}"


def ensure_site() -> Path:
    """The directory holding ``triton``, installed on first use; RegistryUnreachable when pip cannot fetch it."""
    root = site_dir()
    if (root / ".ready").is_file():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".ready").is_file():  # another process finished it while we waited
            return root
        shutil.rmtree(root, ignore_errors=True)
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
               "--target", str(root), f"triton=={TRITON_VERSION}"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip() and "is ignored" not in ln]
            shutil.rmtree(root, ignore_errors=True)
            why = lines[-1] if lines else f"pip exited {proc.returncode}"
            if "No matching distribution" in why or "Could not find" in why or "connection" in why.lower():
                raise RegistryUnreachable(why)
            raise RuntimeError(f"pip install triton=={TRITON_VERSION} failed:\n{proc.stderr[-2000:]}")
        (root / ".ready").write_text(TRITON_VERSION + "\n")
    return root
