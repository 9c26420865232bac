"""Which ``pynvml`` the agent uses: the host's nvidia-ml-py, or the copy shipped in the agent bundle.

The client puts NVIDIA's single-file binding (``pynvml.py`` from its installed nvidia-ml-py, with its BSD
licence and a small manifest) in ``_vendor/`` beside the ``engine`` package, so a host needs only python3
and the driver. Choice: the host's module when it is nvidia-ml-py at least as new as the bundled one (the
host's admin may have matched it to the driver, and it is the copy the host's other tools use); else the
bundled one. NVIDIA's bindings stay compatible with older drivers (a missing call raises FunctionNotFound,
which the sampler treats per field), so the newer binding is the safer one; a host ``pynvml`` without
nvidia-ml-py metadata is the deprecated fork of the PyPI ``pynvml`` project, and loses to the bundle.

Stdlib only; nothing here initialises NVML.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from types import ModuleType

from engine.protocol import NVML_DISTRIBUTION, VENDOR_DIR, VENDORED_MANIFEST, VENDORED_MODULE


class BindingMissing(ImportError):
    """No pynvml on the host and none in the bundle; the message says which and where it looked."""


@dataclass(frozen=True)
class Binding:
    module: ModuleType
    origin: str  # "host nvidia-ml-py 12.560.30" | "bundled nvidia-ml-py 13.615.71" | "host pynvml (unknown version)"


def vendor_dir() -> Path:
    """Where the bundle keeps vendored modules: beside the `engine` package (inside the zip or extracted tree)."""
    import engine

    return Path(engine.__file__).parent.parent / VENDOR_DIR


def _version_key(version: str) -> tuple[int, ...]:
    parts: list[int] = []
    for piece in version.split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def _read(path: Path) -> bytes | None:
    """A file's bytes, also when it lies inside the zipapp (``<bundle.pyz>/_vendor/...``); None when absent."""
    try:
        return path.read_bytes()
    except OSError:
        pass
    archive = path.parent
    while archive != archive.parent and not archive.exists():
        archive = archive.parent
    if not archive.is_file() or not zipfile.is_zipfile(archive):
        return None
    try:
        with zipfile.ZipFile(archive) as zf:
            return zf.read(path.relative_to(archive).as_posix())
    except (KeyError, OSError, zipfile.BadZipFile):
        return None


def _bundled_version(directory: Path) -> str | None:
    raw = _read(directory / VENDORED_MANIFEST)
    try:
        manifest = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    version = manifest.get("version") if isinstance(manifest, dict) else None
    return version if isinstance(version, str) else None


def _host_version() -> str | None:
    """The host's nvidia-ml-py version when `import pynvml` would find it; None when there is no host pynvml."""
    try:
        if importlib.util.find_spec("pynvml") is None:
            return None
    except (ImportError, ValueError):
        return None
    from importlib import metadata  # ~30 ms to import: only when the host has a pynvml at all

    try:
        return metadata.version(NVML_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return ""  # a pynvml without nvidia-ml-py metadata: the deprecated fork


def _import_bundled(directory: Path) -> ModuleType:
    # The folder may sit inside the zipapp: zipimport reads "<bundle.pyz>/_vendor" as a path entry.
    entry = str(directory)
    sys.modules.pop("pynvml", None)
    sys.path.insert(0, entry)
    try:
        return importlib.import_module("pynvml")
    finally:
        sys.path.remove(entry)


@lru_cache(maxsize=1)
def load_pynvml() -> Binding:
    """The binding to use (see the module docstring); raises BindingMissing when there is none."""
    directory = vendor_dir()
    bundled = _bundled_version(directory)
    host = _host_version()
    if host is not None and (bundled is None or (host and _version_key(host) >= _version_key(bundled))):
        module = importlib.import_module("pynvml")
        return Binding(module, f"host {NVML_DISTRIBUTION} {host}" if host else "host pynvml (unknown version)")
    if bundled is not None:
        try:
            return Binding(_import_bundled(directory), f"bundled {NVML_DISTRIBUTION} {bundled}")
        except ImportError as exc:
            raise BindingMissing(f"the agent bundle's {VENDOR_DIR}/{VENDORED_MODULE} does not import: {exc}") from exc
    raise BindingMissing(
        f"python module pynvml not on this host and not in the agent bundle ({directory} has no {VENDORED_MANIFEST})"
    )
