"""Opening a file someone else may have planted: no blocking on a FIFO, no following a link, regular files only.

The supervisor's serve-check lock and log and the trainer's output_dir hold open files in directories other
users or runs may write to; a FIFO there would block the open, a link would redirect a write.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class NotRegularFileError(OSError):
    """The path is there and opens, but is not a regular file (a FIFO, a device, a directory, a socket)."""


def open_regular(path: Path, flags: int, mode: int = 0o600) -> int:
    """``path`` opened with ``flags`` without blocking, without following a link and close-on-exec: its fd.
    OSError (``strerror`` says why: ENXIO a FIFO nobody reads, ELOOP a link); NotRegularFileError when it opens
    but is not a regular file (closed again)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFileError(errno.EINVAL, "not a regular file", str(path))
    return fd
