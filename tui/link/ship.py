"""The agent bundle: the ``engine`` package as one zipapp, shipped to a host that has only ``python3``.

The bundle is built in memory, byte-for-byte reproducible (sorted entries, fixed timestamps), and
named ``<AGENT_VERSION>-<sha256[:16]>.pyz`` so a host keeps one file per content. On the host it
lives at ``<run_root>/agent/<name>``; the bootstrap scripts below run with ``python3 -c`` and write
nothing but ``<run_root>/agent/``: ``CHECK`` verifies the file (sha256), keeps a verified extracted
copy beside it and execs the agent from that copy; ``INSTALL`` reads the bundle from stdin into a
temporary file, verifies its hash, renames, then removes old bundles no process and no recorded run
uses (``HOST_KEEP``). ``PYTHONPATH=<pyz> python3 -m engine.agent.main`` works too; the client uses the
extracted tree as ``PYTHONPATH`` for ``python3 -m engine.trainer``.

Besides ``engine`` the bundle carries ``_vendor/pynvml.py``, NVIDIA's single-file NVML binding taken from
the client's nvidia-ml-py, with its BSD licence (``pynvml.LICENSE``) and a manifest (version, sha256):
a host then needs only python3 and the driver for GPU data (engine/host/nvml_binding.py picks it up).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import time
import zipfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from engine import protocol

# What goes into the bundle: every file of these packages, no tests, no caches, no hidden files.
BUNDLED_PACKAGES: tuple[str, ...] = ("engine",)
_FIXED_DATE = (2020, 1, 1, 0, 0, 0)
_MAIN = b"import sys\n\nfrom engine.agent.main import main\n\nsys.exit(main())\n"

# Exit codes of the bootstrap scripts (besides the agent's own).
BOOT_NEEDS_UPLOAD = 17
INSTALL_HASH_MISMATCH = 18

# argv: RUN_ROOT NAME SHA256 [agent args...]. RUN_ROOT "" means the agent's default (~/.specdec).
# Verifies the bundle; keeps an extracted copy beside it (<name without .pyz>/, every file compared with
# the verified zip at each start) because the supervisor starts `python3 -m engine.supervisor.wrapper`
# from the directory holding `engine`, and torch.compile wants real source files. Prints one JSON line
# {"bootstrap": ..., "path": ..., "tree": ...}, then, when the bundle is good, becomes the agent.
CHECK_SCRIPT = r"""
import hashlib, json, os, shutil, stat, sys, zipfile
root, name, sha = sys.argv[1], sys.argv[2], sys.argv[3]
root = os.path.abspath(os.path.expanduser(root or os.environ.get("SPECDEC_RUN_ROOT") or "~/.specdec"))
path = os.path.join(root, "agent", name)
tree = path[: -len(".pyz")]
def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\n")
    sys.stdout.flush()
h = hashlib.sha256()
try:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
except OSError:
    h = None
if h is None or h.hexdigest() != sha:
    say(bootstrap="upload", path=path)
    sys.exit(17)
try:
    os.utime(path)  # started now: INSTALL's prune keeps the most recently started bundles
except OSError:
    pass
def same(zf, info):
    # a regular file of the zip's size only (a FIFO planted in the tree would block the read), then its bytes
    try:
        fd = os.open(os.path.join(tree, info.filename), os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != info.file_size:
            return False
        try:
            return f.read(info.file_size + 1) == zf.read(info)
        except OSError:
            return False
with zipfile.ZipFile(path) as zf:
    if not (os.path.isdir(tree) and all(same(zf, i) for i in zf.infolist() if not i.is_dir())):
        tmp = "%s.tmp-%d" % (tree, os.getpid())
        shutil.rmtree(tmp, ignore_errors=True)
        zf.extractall(tmp)
        old = "%s.old-%d" % (tree, os.getpid())
        try:
            if os.path.isdir(tree):
                os.rename(tree, old)
            os.rename(tmp, tree)
        except OSError:
            pass  # another client extracted the same verified content at the same moment
        shutil.rmtree(old, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
say(bootstrap="ok", path=path, tree=tree)
boot = "import sys; sys.path.insert(0, sys.argv.pop(1)); from engine.agent.main import main; sys.exit(main())"
os.execv(sys.executable, [sys.executable, "-c", boot, tree, "--run-root", root] + sys.argv[4:])  # with site
"""

# Bundles INSTALL keeps on the host besides the one it installs (the most recently started: CHECK touches each
# bundle it verifies), and how long an older one must have gone unstarted before it goes. A bundle (~3 MB with its
# extracted tree) arrives with every client version and every edit of the engine's sources.
HOST_KEEP = 4
HOST_IDLE_S = 86400.0

# argv: RUN_ROOT NAME SHA256; stdin: the bundle. Writes tmp, verifies, renames; prints the path. Then prunes:
# bundles beyond the HOST_KEEP most recently started, unstarted for HOST_IDLE_S, whose extracted tree no live
# process runs from (cwd, argv or environment naming it) and no recorded run names (restart relaunches its spec),
# go with their trees; so do temporaries of writers and extractors that died (an hour old). It prints what it
# removed; a prune that fails never fails the install.
INSTALL_SCRIPT = (
    f"KEEP, IDLE_S, STRAY_S = {HOST_KEEP}, {HOST_IDLE_S}, 3600.0\n"
    + r"""
import hashlib, json, os, sys
root, name, sha = sys.argv[1], sys.argv[2], sys.argv[3]
root = os.path.expanduser(root or os.environ.get("SPECDEC_RUN_ROOT") or "~/.specdec")
adir = os.path.join(os.path.abspath(root), "agent")
os.makedirs(adir, mode=0o700, exist_ok=True)
path = os.path.join(adir, name)
tmp = "%s.tmp-%d" % (path, os.getpid())
data = sys.stdin.buffer.read()
if hashlib.sha256(data).hexdigest() != sha:
    sys.stderr.write("bundle upload corrupted: got %d bytes with sha256 %s, expected %s\n"
                     % (len(data), hashlib.sha256(data).hexdigest(), sha))
    sys.exit(18)
with open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
os.replace(tmp, path)
import re, shutil, stat, time
BUNDLE_NAME = re.compile(r"[0-9A-Za-z][0-9A-Za-z._+-]*-[0-9a-f]{16}\.pyz")
RECORD_MAX, PROC_MAX, BLOCK = 1 << 20, 16 << 20, 1 << 16
def names(path, marks, limit):
    # The trees (of marks) a file names, read in blocks: a regular file only (a FIFO would block the open and
    # the read for good; O_NONBLOCK opens it at once, fstat says what it is), no link followed, at most limit
    # bytes (a sparse 1 GiB record costs no more than that).
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return set()
    found, tail, left = set(), b"", limit
    keep = max(len(f) for _, forms in marks for f in forms)
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            while left > 0:
                block = os.read(fd, min(BLOCK, left))
                if not block:
                    break
                left -= len(block)
                data = tail + block
                found.update(t for t, forms in marks if any(form in data for form in forms))
                tail = data[-keep:]
    except OSError:
        pass
    finally:
        os.close(fd)
    return found
def in_use(trees):
    # The trees a live process runs from (its cwd, argv or environment names the tree: the agent, a run's
    # supervisor, the engine by PYTHONPATH) or a recorded run would start again (`restart` relaunches its spec).
    # Each tree as written, as JSON writes it, and resolved (a cwd link names the real path).
    marks = [(t, {t.encode(), json.dumps(t)[1:-1].encode(), os.path.realpath(t).encode()}) for t in trees]
    used = set()
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if pid.isdigit():
            try:
                cwd = os.readlink("/proc/%s/cwd" % pid).encode()
                used.update(t for t, forms in marks if any(form in cwd for form in forms))
            except OSError:
                pass
            for item in ("cmdline", "environ"):
                used |= names("/proc/%s/%s" % (pid, item), marks, PROC_MAX)
    runs = os.path.join(os.path.abspath(root), "runs")
    for run in os.listdir(runs) if os.path.isdir(runs) else []:
        for f in ("launch.json", "submitted.json", "spec.json"):
            used |= names(os.path.join(runs, run, f), marks, RECORD_MAX)
    return used
def prune():
    now, others, pruned = time.time(), [], []
    for entry in os.listdir(adir):
        full = os.path.join(adir, entry)
        try:
            info = os.lstat(full)
            age = now - info.st_mtime
            if BUNDLE_NAME.fullmatch(entry) and entry != name and stat.S_ISREG(info.st_mode):
                others.append((age, full))  # only a bundle by its name: never ".pyz" (its tree would be adir)
            elif (".tmp-" in entry or ".old-" in entry) and age > STRAY_S:  # a writer or extractor that died
                shutil.rmtree(full) if stat.S_ISDIR(info.st_mode) else os.unlink(full)
        except OSError:
            continue
    others.sort()
    stale = [full for age, full in others[KEEP:] if age > IDLE_S]
    busy = in_use([full[: -len(".pyz")] for full in stale]) if stale else set()
    for full in stale:
        tree = full[: -len(".pyz")]
        if tree in busy:
            continue
        try:
            os.unlink(full)
        except OSError:
            continue
        shutil.rmtree(tree, ignore_errors=True)
        pruned.append(os.path.basename(full))
    return pruned
try:
    pruned = prune()
except Exception as exc:  # the bundle is installed: a prune that fails must not fail the install
    pruned = []
    sys.stderr.write("agent bundle prune skipped: %s\n" % exc)
sys.stdout.write(json.dumps({"bootstrap": "installed", "path": path, "bytes": len(data), "pruned": pruned}) + "\n")
"""
)


@dataclass(frozen=True)
class Bundle:
    data: bytes
    sha256: str
    version: str

    @property
    def name(self) -> str:
        return f"{self.version}-{self.sha256[:16]}.pyz"


def _source_files(root: Path) -> list[Path]:
    """Every file of the bundled packages (sources and package data such as the trainer's corpus)."""
    files: list[Path] = []
    for pkg in BUNDLED_PACKAGES:
        for path in sorted((root / pkg).rglob("*")):
            rel = path.relative_to(root)
            if not path.is_file() or path.suffix in (".pyc", ".pyo"):
                continue
            if any(part in ("tests", "__pycache__") or part.startswith((".", "test_")) for part in rel.parts):
                continue
            files.append(path)
    return files


def _pynvml_origin() -> Path | None:
    """The file `import pynvml` would load on the client (a single .py file), without importing it."""
    spec = importlib.util.find_spec("pynvml")
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    return Path(spec.origin)


def _client_pynvml() -> Path | None:
    """NVIDIA's pynvml.py of the client's nvidia-ml-py (a dependency), or None when it is not installed."""
    origin = _pynvml_origin()
    if origin is None:
        return None
    from importlib import metadata  # ~30 ms to import: only when the bundle is built

    try:
        metadata.version(protocol.NVML_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None  # the deprecated PyPI `pynvml` fork, not NVIDIA's binding: do not ship it
    return origin


def licence_of(source: str) -> str:
    """The licence text at the head of pynvml.py: its leading comment block, comment marks removed."""
    lines: list[str] = []
    for line in source.splitlines():
        if not line.startswith("#"):
            break
        text = line.lstrip("#")
        lines.append(text[1:] if text.startswith(" ") else text)
    body = "\n".join(lines).strip("\n")
    if "Redistribution and use" not in body:
        raise ValueError("pynvml.py does not start with its BSD licence block: refusing to ship it without one")
    return body + "\n"


def vendored_files() -> dict[str, bytes]:
    """Bundle paths -> bytes of the vendored pynvml (module, licence, manifest); empty without nvidia-ml-py."""
    source_path = _client_pynvml()
    if source_path is None:
        return {}
    from importlib import metadata

    source = source_path.read_bytes()
    version = metadata.version(protocol.NVML_DISTRIBUTION)
    licence = (
        f"pynvml.py is NVIDIA's Python binding for NVML, from {protocol.NVML_DISTRIBUTION} {version}, shipped\n"
        "unchanged inside the specdec-tui agent bundle under these terms:\n\n" + licence_of(source.decode("utf-8"))
    )
    manifest = {
        "distribution": protocol.NVML_DISTRIBUTION,
        "version": version,
        "sha256": hashlib.sha256(source).hexdigest(),
        "license_file": protocol.VENDORED_LICENSE,
    }
    base = protocol.VENDOR_DIR
    return {
        f"{base}/{protocol.VENDORED_MODULE}": source,
        f"{base}/{protocol.VENDORED_LICENSE}": licence.encode("utf-8"),
        f"{base}/{protocol.VENDORED_MANIFEST}": (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode(),
    }


def _package_root() -> Path:
    import engine

    return Path(engine.__file__).resolve().parent.parent


def _add(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=_FIXED_DATE)  # fixed time: the same sources give the same bytes
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = 0o644 << 16
    zf.writestr(info, data)


def build_bundle_bytes(root: Path | None = None) -> bytes:
    """The zipapp's bytes: a shebang line, then a zip of the sources, the vendored pynvml and a ``__main__.py``."""
    root = root or _package_root()
    buf = io.BytesIO()
    buf.write(b"#!/usr/bin/env python3\n")
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in _source_files(root):
            _add(zf, path.relative_to(root).as_posix(), path.read_bytes())
        for name, data in sorted(vendored_files().items()):
            _add(zf, name, data)
        _add(zf, "__main__.py", _MAIN)
    return buf.getvalue()


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "specdec-tui" / "bundles"


def _sources_key(root: Path) -> str:
    """Changes whenever a bundled file is added, removed or modified (path, size, mtime)."""
    h = hashlib.sha256(protocol.AGENT_VERSION.encode())
    for path in _source_files(root):
        st = path.stat()
        h.update(f"{path.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    vendored = _pynvml_origin()
    if vendored is not None:  # an upgraded nvidia-ml-py on the client makes a new bundle
        st = vendored.stat()
        h.update(f"{vendored}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:32]


CACHE_KEEP = 8  # bundles kept in the client's cache, the most recently used first (~390 KB each)
_STRAY_TMP_S = 3600.0  # a .tmp- file this old is a writer that died mid-write


def prune_cache(directory: Path, keep: int = CACHE_KEEP) -> list[Path]:
    """Remove all but the ``keep`` most recently used bundles of the cache (a read touches its file) and stray
    temporary files an hour old; returns what was removed. Every install and every edit of the engine's sources
    makes a new key, so without this the cache only grows. A removed bundle costs one rebuild (~40 ms)."""
    try:
        entries = [(p, p.stat().st_mtime) for p in directory.iterdir() if p.is_file()]
    except OSError:
        return []
    bundles = sorted(((p, t) for p, t in entries if p.name.endswith(".pyz")), key=lambda e: e[1], reverse=True)
    now = time.time()
    stale = [p for p, _ in bundles[keep:]]
    stale += [p for p, t in entries if ".pyz.tmp-" in p.name and now - t > _STRAY_TMP_S]
    removed = []
    for path in stale:
        try:
            path.unlink()
            removed.append(path)
        except OSError:
            pass  # another client's prune got there first, or the cache is read-only
    return removed


@lru_cache(maxsize=1)
def agent_bundle() -> Bundle:
    """The bundle of the engine this client was installed with (built once, then cached on disk by source stats;
    the cache keeps the CACHE_KEEP most recently used)."""
    root = _package_root()
    cached = _cache_dir() / f"{_sources_key(root)}.pyz"
    try:
        data = cached.read_bytes()
        with contextlib.suppress(OSError):
            os.utime(cached)  # used now: the prune keeps the most recently used
    except OSError:
        data = build_bundle_bytes(root)
        try:  # a cache that cannot be written only costs the ~40 ms of building the zip next time
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
            tmp.write_bytes(data)
            tmp.replace(cached)
        except OSError:
            pass
        else:
            prune_cache(cached.parent)
    return Bundle(data=data, sha256=hashlib.sha256(data).hexdigest(), version=protocol.AGENT_VERSION)


def check_argv(python: str, run_root: str | None, bundle: Bundle, agent_args: list[str]) -> list[str]:
    """argv that verifies the installed bundle and, if good, execs the agent from it."""
    # -S: the check needs only the stdlib, and skipping site-packages saves ~40 ms per connect.
    return [python, "-S", "-c", CHECK_SCRIPT, run_root or "", bundle.name, bundle.sha256, *agent_args]


def install_argv(python: str, run_root: str | None, bundle: Bundle) -> list[str]:
    """argv that installs the bundle read from stdin (atomic: tmp, verify, rename)."""
    return [python, "-S", "-c", INSTALL_SCRIPT, run_root or "", bundle.name, bundle.sha256]


def write_bundle(dest_dir: Path) -> Path:
    """Write the bundle into ``dest_dir`` (for inspection and for local use); returns its path."""
    bundle = agent_bundle()
    dest_dir.mkdir(parents=True, exist_ok=True)
    path = dest_dir / bundle.name
    if not path.exists() or hashlib.sha256(path.read_bytes()).hexdigest() != bundle.sha256:
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(bundle.data)
        tmp.replace(path)
    return path
