"""One trainer per output directory: the lock ``hold_output_dir`` takes (stdlib only, so the command takes it before
it writes a first event: a trainer refused there never writes into the running one's ``events.jsonl``)."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import IO

from engine.host.files import open_regular
from engine.trainer.config import ConfigError

RUN_LOCK = ".run.lock"  # <output_dir>/.run.lock: held by the trainer running there, its pid inside


def hold_output_dir(output_dir: Path) -> IO[bytes]:
    """Keeps other trainers out of ``output_dir`` while this process lives: an exclusive POSIX lock on
    ``<output_dir>/.run.lock`` holding this process's pid. The kernel drops it when the process ends, however it
    ends, and forked children do not inherit it. Keep the returned file open. Held by another process: a
    ConfigError in one line naming its pid. On a filesystem that takes no locks the directory is not guarded."""
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file on the way, a read-only parent
        raise ConfigError(f"output_dir: {output_dir} cannot be made a directory ({exc.strerror or exc})") from None
    try:  # a link planted there would take the pid write elsewhere, a FIFO would block the open
        fd = open_regular(output_dir / RUN_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"output_dir: {output_dir / RUN_LOCK} cannot be the run's lock ({exc.strerror or exc}): remove it"
        ) from None
    fh = os.fdopen(fd, "r+b")  # open for the process's life: closing it releases the lock
    try:
        fcntl.lockf(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EACCES, errno.EAGAIN):  # a filesystem without locks (ENOLCK...): unguarded
            return fh
        fh.seek(0)
        holder = fh.read(32).decode("ascii", errors="replace").strip()
        fh.close()
        who = f" (pid {holder})" if holder.isdigit() else ""
        raise ConfigError(
            f"output_dir: {output_dir} is in use by a running trainer{who}: wait for it to end or stop it, "
            "or choose another output_dir"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n".encode())
    fh.flush()
    return fh
