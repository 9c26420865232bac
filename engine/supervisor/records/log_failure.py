"""Why a run failed, read from its output.log: the first exception and torchrun's root-cause summary.

A Python traceback ends with its exception line (``RuntimeError: msg``) after ``Traceback (most recent
call last):``; under torchrun each rank's lines may carry a ``[rank1]:`` prefix. When a worker fails,
torchrun's elastic agent raises ``ChildFailedError`` and prints a summary whose "Root Cause (first observed
failure)" block names the failing rank and its exit code::

    Root Cause (first observed failure):
    [0]:
      time      : 2026-12-01_11:10:03
      host      : localhost
      rank      : 1 (local_rank: 1)
      exitcode  : 1 (pid: 4859)
      error_file: <N/A>
      traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html

``FailureScan`` is fed complete lines as the log grows and keeps only what names the cause, so a long
log costs one pass, without holding it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

TRACEBACK_START = b"Traceback (most recent call last):"
ROOT_CAUSE = b"Root Cause (first observed failure):"
_PREFIX_RE = re.compile(rb"^\[(?:rank|default)?(\d+)\]:\s?")
_EXCEPTION_RE = re.compile(rb"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
_RANK_RE = re.compile(rb"^\s*rank\s*:\s*(\d+)(?:\s*\(local_rank:\s*(\d+)\))?")
_EXITCODE_RE = re.compile(rb"^\s*exitcode\s*:\s*(-?\d+)")
_ERROR_FILE_RE = re.compile(rb"^\s*error_file\s*:\s*(.*)$")
_TRACEBACK_FIELD_RE = re.compile(rb"^\s*traceback\s*:\s*(.*)$")
# Exceptions that only report another process's failure: never the root cause themselves.
_WRAPPER_EXCEPTIONS = frozenset({"ChildFailedError"})
MAX_EXCEPTIONS = 32
MAX_TEXT_CHARS = 300
_ROOT_BLOCK_LINES = 12


def _is_wrapper(text: str) -> bool:
    return text.split(":", 1)[0].rsplit(".", 1)[-1] in _WRAPPER_EXCEPTIONS


def _text(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").strip()
    return text if len(text) <= MAX_TEXT_CHARS else text[: MAX_TEXT_CHARS - 1] + "…"


@dataclass
class Failure:
    """What the log says went wrong. ``exceptions``: (rank or None, "Type: message") in log order."""

    exceptions: list[tuple[int | None, str]] = field(default_factory=list)
    root_rank: int | None = None
    root_local_rank: int | None = None
    root_exitcode: int | None = None
    root_detail: str | None = None  # the summary's error_file/traceback when it says more than "see the docs"

    def root_exception(self) -> str | None:
        """The failing rank's first exception when torchrun named the rank; else the log's first exception."""
        own = [(rank, text) for rank, text in self.exceptions if not _is_wrapper(text)]
        if self.root_rank is not None:
            # The failing rank's own line, else one no rank prefix marks (torch without per-rank prefixes).
            own = [(r, t) for r, t in own if r == self.root_rank] or [(r, t) for r, t in own if r is None]
        return own[0][1] if own else None

    def describe(self) -> str | None:
        """One sentence naming the root cause, or None when the log names none."""
        exc = self.root_exception()
        if self.root_rank is not None:
            where = f"rank {self.root_rank}" + (
                f" (local_rank {self.root_local_rank})" if self.root_local_rank is not None else ""
            )
            code = f" exited with code {self.root_exitcode}" if self.root_exitcode is not None else " failed"
            detail = f": {exc}" if exc else (f": {self.root_detail}" if self.root_detail else "")
            return f"torchrun: {where}{code}{detail}"
        return exc


class FailureScan:
    """Incremental: ``feed`` complete lines (bytes ending in newlines) in log order."""

    def __init__(self) -> None:
        self.failure = Failure()
        self._open: dict[int | None, bool] = {}  # prefix rank -> inside a traceback, waiting for its last line
        self._root_lines_left = 0

    def feed(self, data: bytes) -> None:
        if not self._open and not self._root_lines_left:
            t = data.find(TRACEBACK_START)
            r = data.find(ROOT_CAUSE)
            starts = [i for i in (t, r) if i >= 0]
            if not starts:
                return  # the common case: nothing to look at in this chunk
            data = data[data.rfind(b"\n", 0, min(starts)) + 1 :]
        for line in data.split(b"\n"):
            self._line(line.rstrip(b"\r"))

    def _line(self, line: bytes) -> None:
        if self._root_lines_left:
            self._root_lines_left -= 1
            self._root_field(line)
            return
        m = _PREFIX_RE.match(line)
        rank = int(m.group(1)) if m else None
        body = line[m.end() :] if m else line
        if body.startswith(TRACEBACK_START):
            self._open[rank] = True
            return
        if body.startswith(ROOT_CAUSE):
            self._root_lines_left = _ROOT_BLOCK_LINES
            return
        if not self._open.get(rank) or not body or body[:1].isspace():
            return  # outside a traceback, or one of its indented frame lines
        em = _EXCEPTION_RE.match(body)
        if em is None:
            return  # e.g. "During handling of the above exception ..." belongs to a chain already counted
        del self._open[rank]
        if len(self.failure.exceptions) < MAX_EXCEPTIONS:
            self.failure.exceptions.append((rank, _text(body)))

    def _root_field(self, line: bytes) -> None:
        f = self.failure
        if line.startswith(b"=") or (line.startswith(b"[") and f.root_rank is not None):
            self._root_lines_left = 0  # the block ended (or a second failure starts): the first one is the root
            return
        if (m := _RANK_RE.match(line)) and f.root_rank is None:
            f.root_rank = int(m.group(1))
            f.root_local_rank = int(m.group(2)) if m.group(2) else None
        elif (m := _EXITCODE_RE.match(line)) and f.root_exitcode is None:
            f.root_exitcode = int(m.group(1))
        elif (m := _ERROR_FILE_RE.match(line)) or (m := _TRACEBACK_FIELD_RE.match(line)):
            value = _text(m.group(1))
            if value and value != "<N/A>" and not value.startswith("To enable traceback") and f.root_detail is None:
                f.root_detail = value


_STEP_NUMBER_RE = re.compile(rb"\d+")


def last_step_in(data: bytes, step_re: re.Pattern[bytes]) -> int | None:
    """The step number of the last match of the profile's step pattern in ``data`` (its first group, else the
    last number in the match), or None."""
    last: re.Match[bytes] | None = None
    for last in step_re.finditer(data):  # noqa: B007 - only the last match is wanted
        pass
    if last is None:
        return None
    text = last.group(1) if step_re.groups else last.group(0)
    numbers = _STEP_NUMBER_RE.findall(text or b"")
    return int(numbers[-1]) if numbers else None
