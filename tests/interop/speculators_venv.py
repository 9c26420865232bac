"""A private venv with the PyPI ``speculators`` package, cached per version under ~/.cache/specdec-tui/.

It shares this interpreter's torch and transformers (``--system-site-packages``; when this interpreter is itself a
venv's, whose ``--system-site-packages`` would reach only the base Python's, a ``.pth`` file adds this venv's
site-packages after the private venv's own) and installs speculators and its
connector package without their dependency lists (those pull torchvision/torchaudio builds that break transformers
on the CPU torch), then only the pure-python packages its EAGLE-3 import chain needs. A ``.ready`` file marks a
complete venv, so later runs start at once; a lock keeps two test processes from building it together.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SPECULATORS_VERSION = "0.9.0"
NO_DEPS = (f"speculators=={SPECULATORS_VERSION}", f"hs-connectors=={SPECULATORS_VERSION}")
WITH_DEPS = ("openai>=2.0.0", "datasets>=4.0.0,<=5.1.0", "loguru>=0.7.2,<=0.7.3")
PIP_TIMEOUT_S = 600


class RegistryUnreachable(RuntimeError):
    """The package registry did not answer: the check cannot run here (not a failure of the export)."""


def venv_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specdec-tui" / f"speculators-{SPECULATORS_VERSION}"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def _pip(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)


def registry_reachable() -> str | None:
    """None when pip can fetch the speculators wheel; else pip's last line of complaint."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, NO_DEPS[0]]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip() and "is ignored" not in ln]
    return lines[-1] if lines else f"pip download exited {proc.returncode}"


SHARED_PTH = "specdec-shared-site.pth"


def share_this_venv(python: Path) -> None:
    """Inside a venv, the private venv's ``--system-site-packages`` is the base Python's: put this venv's
    site-packages (its torch, transformers) on the private venv's path too, after its own."""
    if sys.prefix == sys.base_prefix:
        return  # not in a venv: --system-site-packages already shares this interpreter's packages
    ours = list(dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")))
    where = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    (Path(where) / SHARED_PTH).write_text("".join(f"{p}\n" for p in ours))


def ensure_venv() -> Path:
    """The venv's python, built on first use; RegistryUnreachable when the registry cannot be reached."""
    root = venv_dir()
    if (root / ".ready").is_file():
        share_this_venv(venv_python())  # the venv running the tests may have changed since it was built
        return venv_python()
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".ready").is_file():  # another process finished it while we waited
            return venv_python()
        why = registry_reachable()
        if why is not None:
            raise RegistryUnreachable(why)
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(root)], check=True, timeout=120)
        share_this_venv(venv_python())
        for args in (("--no-deps", *NO_DEPS), WITH_DEPS):
            proc = _pip(venv_python(), *args)
            if proc.returncode != 0:
                raise RuntimeError(f"pip install {' '.join(args)} failed:\n{proc.stderr[-2000:]}")
        (root / ".ready").write_text(SPECULATORS_VERSION + "\n")
    return venv_python()
