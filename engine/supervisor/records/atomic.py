"""Atomic writes of a run's records: a reader sees the old file or the complete new one, never half, and the exit
record survives a full disk (its blocks are taken before the job starts).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from engine import protocol
from engine.supervisor.records.documents import ExitRecord
from engine.supervisor.records.layout import EXIT_JSON, EXIT_RESERVED

EXIT_RESERVE_BYTES = 16 * 1024


def write_json_atomic(path: Path | str, obj: Any, mode: int = 0o644) -> None:
    """Write JSON so a reader sees the old file or the complete new one, never half (tmp + fsync + rename)."""
    target = Path(path)
    data = (json.dumps(protocol.to_jsonable(obj), indent=1, sort_keys=True) + "\n").encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
    try:
        dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is atomic
    finally:
        os.close(dfd)


def reserve_exit_record(run_dir: Path | str) -> bool:
    """Allocate the exit record's space now (a padded placeholder, fsynced), so the record survives a full disk.

    False when even that cannot be written (the disk is full already): the exit is then recorded only if there
    is room when the job ends.
    """
    path = Path(run_dir) / EXIT_RESERVED
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:
        return False
    try:
        view = memoryview(b" " * (EXIT_RESERVE_BYTES - 1) + b"\n")
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        return False
    os.close(fd)
    return True


def write_exit_record(run_dir: Path | str, exit_rec: ExitRecord) -> None:
    """Write exit.json atomically; when the disk is full, into the space reserve_exit_record took, renamed."""
    rd = Path(run_dir)
    rec = exit_rec.to_json()
    try:
        write_json_atomic(rd / EXIT_JSON, rec)
    except OSError:
        if not _fill_reserved_exit(rd, rec):
            raise
    else:
        (rd / EXIT_RESERVED).unlink(missing_ok=True)


def _fill_reserved_exit(rd: Path, rec: dict[str, Any]) -> bool:
    """Overwrite the reserved blocks in place (no new blocks needed), then rename them to exit.json."""
    path = rd / EXIT_RESERVED
    fit = dict(rec)
    data = json.dumps(protocol.to_jsonable(fit), sort_keys=True).encode()
    if len(data) >= EXIT_RESERVE_BYTES:
        fit["forwarded_signals"] = (fit.get("forwarded_signals") or [])[:4]
        fit["cause"] = str(fit.get("cause") or "")[:1000]
        data = json.dumps(protocol.to_jsonable(fit), sort_keys=True).encode()
    if len(data) >= EXIT_RESERVE_BYTES:
        return False
    padded = data + b" " * (EXIT_RESERVE_BYTES - 1 - len(data)) + b"\n"  # the same size: JSON ignores the spaces
    try:
        fd = os.open(path, os.O_WRONLY)  # no O_TRUNC: the blocks stay allocated
    except OSError:
        return False
    try:
        view = memoryview(padded)
        offset = 0
        while offset < len(padded):
            offset += os.pwrite(fd, view[offset:], offset)
        os.fsync(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        os.replace(path, rd / EXIT_JSON)
    except OSError:
        return False
    try:
        dfd = os.open(rd, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return True
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return True
