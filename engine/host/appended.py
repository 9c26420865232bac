"""Files that only grow (a job's log, JSON-lines events), read by byte offset: the one reader of appended files.

An ``AppendedFile`` knows how far it was read (``offset``), which file that offset belongs to (inode and
device: a file renamed over the path, or created anew, starts again at 0) and the bytes read beyond the
offset but held back (``carry``: a partial last line, handed out once its line is complete). Two ways to
follow one:

* by descriptor (``open``/``read``/``replaced``): the open file is read to its end before a new file under
  the same path is taken, so lines written just before a rename are not lost;
* by path (``check``/``read_path``): each read opens the path, so following many files holds no descriptor.

``skip_to`` leaves bytes unread (a huge file's middle): reading resumes at the first line that starts at or
after the offset, and ``skipped_bytes`` counts what was never handed out, so a reader can say it is incomplete.

``last_lines`` reads a file's end backwards (bounded); the agent's ``tail`` and the supervisor's failure
report both use it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
LINE_ENDS = (b"\n",)
TAIL_MAX_BYTES = 8 * 1024 * 1024  # last_lines looks back at most this far: a gigabyte line must not stall a reader


def utf8_cut(data: bytes) -> int:
    """Length of ``data`` without a trailing incomplete UTF-8 sequence (so chunks split between characters)."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        if b & 0x80 == 0:
            return n  # ASCII: complete
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n if back >= need else n - back
    return n  # only continuation bytes: invalid anyway, send as is


class AppendedFile:
    """One growing file: ``offset`` (bytes handed out), ``carry`` (read beyond it, held back), its identity."""

    def __init__(self, path: str | os.PathLike[str], offset: int = 0, inode: int | None = None) -> None:
        self.path = os.fspath(path)
        self.offset = max(0, offset)
        self.inode = inode
        self.dev: int | None = None
        self.carry = b""
        self.skipped_bytes = 0  # never handed out: skipped by ``skip_to`` (the carry dropped, the gap, a cut line)
        self._resync = False  # the next bytes read finish a line that began before a skip: dropped up to its end
        self._fd: int | None = None

    @property
    def position(self) -> int:
        """Where the next read starts: the bytes handed out and those held back."""
        return self.offset + len(self.carry)

    def restart(self, offset: int = 0) -> None:
        """Continue from ``offset`` of the file, dropping what was held back."""
        self.offset, self.carry, self._resync = offset, b"", False

    def skip_to(self, offset: int) -> None:
        """Leave the bytes from ``position`` up to ``offset`` unread, and the rest of a line cut there: lines are
        handed out again from the first one that starts at or after ``offset``. The carry is dropped too."""
        if offset <= self.position:
            return
        # Read again from the byte before: a newline there makes ``offset`` a line start, dropped alone.
        self.skipped_bytes += len(self.carry) + (offset - 1 - self.position)
        self.restart(offset - 1)
        self._resync = True

    # -- by descriptor ---------------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open(self) -> os.stat_result | None:
        """Open the path (None when there is no such file) and take its identity."""
        try:
            fd = os.open(self.path, os.O_RDONLY | _O_CLOEXEC)
        except FileNotFoundError:
            return None
        st = os.fstat(fd)
        self._fd, self.inode, self.dev = fd, st.st_ino, st.st_dev
        return st

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def size(self) -> int:
        """The open file's size now."""
        assert self._fd is not None
        return os.fstat(self._fd).st_size

    def replaced(self) -> bool:
        """The path names another file than the open one now (renamed over, recreated); False while it names none."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (st.st_ino, st.st_dev) != (self.inode, self.dev)

    def read(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` of the open file from ``position``; the caller hands them out or carries them."""
        assert self._fd is not None
        return os.pread(self._fd, max_bytes, self.position)

    # -- by path ---------------------------------------------------------------------------------

    def check(self) -> tuple[os.stat_result | None, str | None]:
        """Stat the path: (its stat or None when missing, why following started over at 0 or None).

        "rotated": the path names another file than the one read so far; "truncated": it shrank below
        ``position``.
        """
        try:
            st = os.stat(self.path)
        except OSError:
            return None, None
        reason = None
        if self.inode is not None and st.st_ino != self.inode:
            reason = "rotated"
        elif self.inode is not None and st.st_size < self.position:
            reason = "truncated"
        if reason is not None:
            self.restart(0)
        self.inode, self.dev = st.st_ino, st.st_dev
        return st, reason

    def read_path(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` from ``position``, opening the path for this read only; b"" when unreadable."""
        try:
            with open(self.path, "rb") as fh:
                return os.pread(fh.fileno(), max_bytes, self.position)
        except OSError:
            return b""

    # -- lines -----------------------------------------------------------------------------------

    def take_complete(
        self, data: bytes, ends: tuple[bytes, ...] = LINE_ENDS, max_carry_bytes: int | None = None
    ) -> tuple[int, bytes]:
        """Hand out the complete lines that ``data`` (just read at ``position``) finishes: (their start offset, the
        bytes up to and including the last line end). The partial rest is carried; a carry longer than
        ``max_carry_bytes`` (a line without end) is handed out as it is."""
        if self._resync:
            nl = min((i for i in (data.find(end) for end in ends) if i >= 0), default=-1)
            dropped = len(data) if nl < 0 else nl + 1
            self.offset += dropped
            self.skipped_bytes += dropped
            self._resync = nl < 0
            data = data[dropped:]
        start = self.offset
        chunk = self.carry + data
        cut = max(chunk.rfind(end) for end in ends)
        complete, self.carry = (chunk[: cut + 1], chunk[cut + 1 :]) if cut >= 0 else (b"", chunk)
        if max_carry_bytes is not None and len(self.carry) > max_carry_bytes:
            complete, self.carry = chunk, b""
        self.offset += len(complete)
        return start, complete


def split_lines(start: int, complete: bytes) -> list[tuple[int, bytes]]:
    """(offset after its newline, line without it) for each line of ``complete`` that begins at ``start``."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    while True:
        nl = complete.find(b"\n", pos)
        if nl < 0:
            if pos < len(complete):
                out.append((start + len(complete), complete[pos:]))  # a line handed out without its end
            return out
        out.append((start + nl + 1, complete[pos:nl]))
        pos = nl + 1


@dataclass
class Tail:
    """The last lines of a file (bytes, without their newlines) and where following it continues."""

    lines: list[bytes]
    offset: int  # the file's size when read: a follower resumes here
    inode: int
    partial: bool = False  # the last line has no newline yet
    window_cut: bool = False  # the look-back window ended before n whole lines were found
    starts_mid_line: bool = False  # the first line is the end of a line that began before the window


def last_lines(
    path: str | os.PathLike[str], n: int, block_bytes: int = 64 * 1024, max_bytes: int = TAIL_MAX_BYTES
) -> Tail:
    """The last ``n`` lines of a file, reading back at most ``max_bytes`` in blocks; OSError when unreadable."""
    with open(os.fspath(path), "rb") as fh:
        st = os.fstat(fh.fileno())
        size = st.st_size
        if n <= 0 or size == 0:
            return Tail([], size, st.st_ino)
        pos = size
        chunks: list[bytes] = []
        newlines = 0
        # A trailing newline ends the last line; it does not start an empty one.
        while pos > 0 and newlines <= n and size - pos < max_bytes:
            step = min(block_bytes, pos, max_bytes - (size - pos))
            pos -= step
            fh.seek(pos)
            data = fh.read(step)
            chunks.append(data)
            newlines += data.count(b"\n")
        buf = b"".join(reversed(chunks))  # one join: growing a bytes object block by block is quadratic
        starts_mid_line = False
        if pos > 0:
            fh.seek(pos - 1)
            starts_mid_line = fh.read(1) != b"\n"
    body = buf[:-1] if buf.endswith(b"\n") else buf
    lines = body.split(b"\n")
    window_cut = pos > 0 and len(lines) <= n
    if len(lines) > n:
        lines = lines[-n:]
        starts_mid_line = False
    return Tail(lines, size, st.st_ino, not buf.endswith(b"\n"), window_cut, starts_mid_line)
