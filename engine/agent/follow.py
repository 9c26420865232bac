"""Follow a growing file by byte offset and inode, losslessly (nothing skipped, nothing repeated).

``LogFollower.poll()`` returns protocol events:

* ``log``:       {"offset", "inode", "data"}: ``data`` (``protocol.encode_log_data`` of the bytes) starts
                 at byte ``offset`` of the file with inode ``inode``; at most ``chunk_bytes`` each.
* ``log_reset``: {"inode", "offset", "reason"}: following restarts at ``offset`` of file ``inode``.
  Reasons: "created" (the file appeared after we started waiting for it), "rotated" (the path now names
  another file, or a resume asked for an inode that is gone), "truncated" (the file shrank below our offset).

Rotation: the old descriptor is read to its end before switching, so lines written just before a
rename are not lost. Polling ``stat`` every ~50 ms costs microseconds; no inotify needed.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from engine.host.appended import TAIL_MAX_BYTES, AppendedFile, last_lines, split_lines, utf8_cut
from engine.protocol import encode_log_data, event

CHUNK_BYTES = 256 * 1024
POLL_BYTES = 4 * 1024 * 1024  # per poll, so a burst is streamed in slices, not in one gulp
POLL_INTERVAL_S = 0.05


class _AppendedFileUser:
    """What the log follower and the events reader share: the file they follow, its position and identity."""

    file: AppendedFile

    @property
    def offset(self) -> int:
        return self.file.offset

    @property
    def inode(self) -> int | None:
        return self.file.inode

    def close(self) -> None:
        self.file.close()


class LogFollower(_AppendedFileUser):
    """Follows one path as protocol events. ``offset``/``inode``: resume position a client gave (None: from the start).

    A thin user of ``AppendedFile`` (by descriptor, nothing carried: a character cut at a chunk's end is read
    again with the next chunk).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        offset: int | None = None,
        inode: int | None = None,
        chunk_bytes: int = CHUNK_BYTES,
        poll_bytes: int = POLL_BYTES,
        announce_open: bool = False,
        start_tail_bytes: int | None = None,
    ) -> None:
        """``announce_open``: emit ``log_reset`` "created" on the first open too (a newly followed run).
        ``start_tail_bytes``: with no offset given, a file larger than this starts at the first line of its last
        ``start_tail_bytes`` (``skipped_head`` then says how many bytes before it were not sent)."""
        self.path = os.fspath(path)
        self.start_tail_bytes = start_tail_bytes if offset is None else None
        self.skipped_head = 0
        self.chunk_bytes = max(1, chunk_bytes)
        self.poll_bytes = max(self.chunk_bytes, poll_bytes)
        self._want_offset = max(0, offset or 0)
        self._want_inode = inode
        self.file = AppendedFile(self.path)
        self._seen_missing = announce_open
        self._opened_once = False
        self.more = False  # the last poll stopped at its byte budget: poll again at once

    def __enter__(self) -> LogFollower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def position(self) -> dict[str, int | None]:
        return {"offset": self.offset, "inode": self.inode}

    def _open(self, out: list[dict[str, Any]]) -> bool:
        st = self.file.open()
        if st is None:
            self._seen_missing = True
            return False
        if not self._opened_once:
            self._opened_once = True
            if self._want_inode is not None and self._want_inode != st.st_ino:
                self.file.restart(0)
                out.append(event("log_reset", inode=st.st_ino, offset=0, reason="rotated"))
            elif self._want_offset > st.st_size:
                self.file.restart(0)
                out.append(event("log_reset", inode=st.st_ino, offset=0, reason="truncated"))
            else:
                start = self._want_offset
                if self.start_tail_bytes is not None and st.st_size > self.start_tail_bytes:
                    start = self.skipped_head = self._line_start(st.st_size - self.start_tail_bytes)
                self.file.restart(start)
                if self._seen_missing:
                    out.append(event("log_reset", inode=st.st_ino, offset=self.offset, reason="created"))
        else:
            self.file.restart(0)
            reason = "rotated" if not self._seen_missing else "created"
            out.append(event("log_reset", inode=st.st_ino, offset=0, reason=reason))
        self._seen_missing = False
        return True

    def _line_start(self, offset: int) -> int:
        """The first line start at or after ``offset`` (within 64 KiB; else ``offset`` itself), read through the
        open file: the path may name another one by now."""
        self.file.restart(offset - 1)
        cut = self.file.read(1 << 16).find(b"\n")
        return offset + cut if cut >= 0 else offset

    def _read(self, out: list[dict[str, Any]], budget: int) -> int:
        """Read from the offset towards EOF, up to ``budget`` bytes; sets ``more`` when the budget ran out."""
        total = 0
        while total < budget:
            want = min(self.chunk_bytes, budget - total)
            data = self.file.read(want)
            if not data:
                break
            if len(data) == want:
                cut = utf8_cut(data)
                if cut == 0 and want < self.chunk_bytes:
                    self.more = True  # the budget's tail holds only part of a character: next poll sends it whole
                    return total
                if cut > 0:
                    data = data[:cut]
            out.append(event("log", offset=self.offset, inode=self.inode, data=encode_log_data(data)))
            self.file.offset += len(data)
            total += len(data)
        if total >= budget:
            self.more = True
        return total

    def poll(self) -> list[dict[str, Any]]:
        """Everything new since the last poll (up to ``poll_bytes``), as log/log_reset events."""
        out: list[dict[str, Any]] = []
        self.more = False
        if not self.file.is_open and not self._open(out):
            return out
        budget = self.poll_bytes
        if self.file.size() < self.offset:
            self.file.restart(0)
            out.append(event("log_reset", inode=self.inode, offset=0, reason="truncated"))
        budget -= self._read(out, budget)
        if self.more:
            return out
        if self.file.replaced():
            budget -= self._read(out, budget)  # finish the old file first
            if self.more:
                return out
            self.close()
            self._seen_missing = False
            if self._open(out):
                self._read(out, budget)
        return out

    def follow(
        self,
        emit: Callable[[dict[str, Any]], None],
        stop: threading.Event,
        interval_s: float = POLL_INTERVAL_S,
    ) -> None:
        """Poll until ``stop`` is set, emitting every event."""
        while not stop.is_set():
            for ev in self.poll():
                emit(ev)
            if not self.more:
                stop.wait(interval_s)


class JsonlReader(_AppendedFileUser):
    """Reads whole lines of a growing JSON-lines file; a partial last line is held back until complete.

    ``poll()`` returns (end_offset, line_bytes) pairs, ``end_offset`` being the byte after the newline (``offset``:
    the byte after the last complete line returned),
    so a client resuming from it gets the next line. Truncation or rotation restarts at 0 and sets
    ``reset`` (the caller can tell clients). A thin user of ``AppendedFile`` (by descriptor, the partial
    line carried).

    Bounded: one poll reads at most ``poll_bytes`` (``more`` then says to poll again at once), and with a
    ``window`` (head_bytes, tail_bytes) a read from byte 0 of a file larger than both takes its head's lines, then
    skips to its last ``tail_bytes``; ``skipped_bytes`` counts what was never returned.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        offset: int = 0,
        max_line_bytes: int = 8 * 1024 * 1024,
        poll_bytes: int = POLL_BYTES,
        window: tuple[int, int] | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.file = AppendedFile(self.path, offset)
        self.max_line_bytes = max_line_bytes
        self.poll_bytes = max(1, poll_bytes)
        self.window = window
        self.reset: str | None = None  # reason of the last restart at 0, cleared by the caller
        self.more = False  # the last poll stopped at its byte budget: poll again at once

    @property
    def skipped_bytes(self) -> int:
        return self.file.skipped_bytes

    def _restart(self, reason: str) -> None:
        self.file.restart(0)
        self.reset = reason

    def _lines(self, out: list[tuple[int, bytes]], data: bytes) -> None:
        out.extend(split_lines(*self.file.take_complete(data, max_carry_bytes=self.max_line_bytes)))

    def _drain(self, out: list[tuple[int, bytes]], budget: int) -> int:
        """Read towards EOF, up to ``budget`` bytes (sets ``more`` when it ran out); what is left of the budget."""
        if self.window is not None and self.file.position == 0:
            head_bytes, tail_bytes = self.window
            size = self.file.size()
            if size > head_bytes + tail_bytes:
                self._lines(out, self.file.read(head_bytes))
                self.file.skip_to(size - tail_bytes)
        while budget > 0:
            data = self.file.read(min(CHUNK_BYTES, budget))
            if not data:
                return budget
            budget -= len(data)
            self._lines(out, data)
        self.more = True
        return 0

    def poll(self) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        self.more = False
        if not self.file.is_open:
            st = self.file.open()
            if st is None:
                return out
            if st.st_size < self.offset:
                self._restart("truncated")
        if self.file.size() < self.file.position:
            self._restart("truncated")
        budget = self._drain(out, self.poll_bytes)
        if not self.more and self.file.replaced():
            budget = self._drain(out, budget)  # finish the old file first
            if self.more:
                return out
            self.close()
            self._restart("rotated")
            if self.file.open() is not None:
                self._drain(out, budget)
        return out


TAIL_CUT_MARK = b"[...cut] "


def tail_lines(
    path: str | os.PathLike[str], n: int, block_bytes: int = 64 * 1024, max_bytes: int = TAIL_MAX_BYTES
) -> dict[str, Any]:
    """The last ``n`` lines of a file (lossless text), with the offset of its end and its inode.

    ``offset``/``inode`` are what a follower resumes from to continue right after these lines. At most
    ``max_bytes`` are read back; a line that starts before that window comes back as its end, behind
    ``TAIL_CUT_MARK``, and ``window_cut`` says that fewer than ``n`` lines came back for that reason.
    """
    tail = last_lines(path, n, block_bytes, max_bytes)
    if not tail.lines and (n <= 0 or tail.offset == 0):
        return {"lines": [], "offset": tail.offset, "inode": tail.inode}
    lines = list(tail.lines)
    if tail.starts_mid_line:
        lines[0] = TAIL_CUT_MARK + lines[0]
    # "partial": the last line has no newline yet (a follower continues it from ``offset``).
    return {
        "lines": [encode_log_data(line) for line in lines],
        "offset": tail.offset,
        "inode": tail.inode,
        "partial": tail.partial,
        "window_cut": tail.window_cut,
    }


def tail_start(path: str | os.PathLike[str], n: int, block_bytes: int = 1024 * 1024) -> dict[str, Any]:
    """Where the last ``n`` lines of a file begin, for any ``n`` (no look-back limit): ``start`` (a line start),
    ``offset`` (the file's size, read when asked) and ``inode``. The bytes in between are read in chunks
    (``read_range``) rather than returned at once, so a million-line request costs no big reply."""
    p = os.fspath(path)
    with open(p, "rb") as fh:
        st = os.fstat(fh.fileno())
        size = st.st_size
        if n <= 0 or size == 0:
            return {"start": size, "offset": size, "inode": st.st_ino}
        pos = size
        # A trailing newline ends the last line; it does not start an empty one.
        wanted = n + 1 if _byte_at(fh, size - 1) == b"\n" else n
        while pos > 0:
            step = min(block_bytes, pos)
            pos -= step
            fh.seek(pos)
            block = fh.read(step)
            count = block.count(b"\n")
            if count >= wanted:
                cut = len(block)
                for _ in range(wanted):
                    cut = block.rindex(b"\n", 0, cut)
                return {"start": pos + cut + 1, "offset": size, "inode": st.st_ino}
            wanted -= count
    return {"start": 0, "offset": size, "inode": st.st_ino}


def _byte_at(fh: Any, pos: int) -> bytes:
    fh.seek(pos)
    return bytes(fh.read(1))


def read_range(path: str | os.PathLike[str], offset: int, max_bytes: int) -> dict[str, Any]:
    """Up to ``max_bytes`` of a file from ``offset`` (cut before an incomplete UTF-8 character unless that
    would leave nothing), with the file's inode and current size."""
    p = os.fspath(path)
    with open(p, "rb") as fh:
        st = os.fstat(fh.fileno())
        data = os.pread(fh.fileno(), max(0, max_bytes), offset) if offset < st.st_size else b""
    if len(data) == max_bytes:
        cut = utf8_cut(data)
        data = data[:cut] if cut > 0 else data
    return {"data": encode_log_data(data), "offset": offset, "inode": st.st_ino, "size": st.st_size}
