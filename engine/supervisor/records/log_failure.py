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

A job that dies without a traceback still says why in its own words: a shell's ``bash: start_training.sh: No
such file or directory``, a tool's ``error: ...``, ``specdec-train: config error: ...``. The first such line is
the cause when no exception names one. A line saying ``No space left on device`` names a full disk, whatever
else the log says.

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
# A job's own error words outside a traceback: "prog: [line N: ]what: No such file or directory" (shells, exec
# failures) or "[prog: ][config ]error: ..." (tools, our trainer). Our wrapper's "[specdec] ..." lines are no job's.
_ERROR_LINE_RE = re.compile(
    rb"^(?:(?:[\w.+/-]+: )+(?:line \d+: )?.*(?:No such file or directory|command not found|Permission denied"
    rb"|not found|Is a directory|cannot execute|Exec format error|No space left on device)"
    rb"|(?:[\w.+/-]+: )*(?:[A-Za-z]+ )?(?:error|fatal|ERROR|FATAL|Error|Fatal): \S.*)\s*$",
    re.MULTILINE,
)
DISK_FULL = b"No space left on device"
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
    first_error: str | None = None  # the job's first own error line outside a traceback (shell errors and the like)
    disk_full: str | None = None  # the first line that says "No space left on device"

    def root_exception(self) -> str | None:
        """The failing rank's first exception when torchrun named the rank; else the log's first exception."""
        own = [(rank, text) for rank, text in self.exceptions if not _is_wrapper(text)]
        if self.root_rank is not None:
            # The failing rank's own line, else one no rank prefix marks (torch without per-rank prefixes).
            own = [(r, t) for r, t in own if r == self.root_rank] or [(r, t) for r, t in own if r is None]
        return own[0][1] if own else None

    def describe(self) -> str | None:
        """One sentence naming the root cause, or None when the log names none."""
        named = self._describe()
        if self.disk_full is not None and (named is None or DISK_FULL.decode() not in named):
            return f"disk full: {self.disk_full}" + (f" (then {named})" if named else "")
        return named

    def _describe(self) -> str | None:
        exc = self.root_exception()
        if self.root_rank is not None:
            where = f"rank {self.root_rank}" + (
                f" (local_rank {self.root_local_rank})" if self.root_local_rank is not None else ""
            )
            code = f" exited with code {self.root_exitcode}" if self.root_exitcode is not None else " failed"
            detail = f": {exc}" if exc else (f": {self.root_detail}" if self.root_detail else "")
            return f"torchrun: {where}{code}{detail}"
        return exc or self.first_error


class FailureScan:
    """Incremental: ``feed`` complete lines (bytes ending in newlines) in log order."""

    def __init__(self) -> None:
        self.failure = Failure()
        self._open: dict[int | None, bool] = {}  # prefix rank -> inside a traceback, waiting for its last line
        self._root_lines_left = 0

    def feed(self, data: bytes) -> None:
        self._own_words(data)
        if not self._open and not self._root_lines_left:
            t = data.find(TRACEBACK_START)
            r = data.find(ROOT_CAUSE)
            starts = [i for i in (t, r) if i >= 0]
            if not starts:
                return  # the common case: nothing to look at in this chunk
            data = data[data.rfind(b"\n", 0, min(starts)) + 1 :]
        for line in data.split(b"\n"):
            self._line(line.rstrip(b"\r"))

    def _own_words(self, data: bytes) -> None:
        """The first error line and the first disk-full line, each looked for until found (one search per chunk)."""
        f = self.failure
        if f.disk_full is None and (i := data.find(DISK_FULL)) >= 0:
            start = data.rfind(b"\n", 0, i) + 1
            end = data.find(b"\n", i)
            f.disk_full = _text(data[start : end if end >= 0 else len(data)])
        if f.first_error is None:
            for m in _ERROR_LINE_RE.finditer(data):
                if not m.group(0).startswith(b"[specdec]"):
                    f.first_error = _text(m.group(0))
                    break

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
    """The step number of the last match of the profile's step pattern in ``data``: its first capture group when
    it has one, else the first integer of the match (``\\d+/1000`` on ``90/1000`` is step 90); None when none."""
    last: re.Match[bytes] | None = None
    for last in step_re.finditer(data):  # noqa: B007 - only the last match is wanted
        pass
    if last is None:
        return None
    text = last.group(1) if step_re.groups else last.group(0)
    number = _STEP_NUMBER_RE.search(text or b"")
    return int(number.group(0)) if number else None
