"""Reading a JSON-lines data file row by row without trusting it: the training data and ``regenerate``'s input.

The path must be a regular file (opened without blocking, so a FIFO is refused instead of waiting for a writer),
and no row is ever held longer than ``MAX_ROW_BYTES``: a longer line is read past in small chunks and reported
by its size, so one 100 MB row costs no more memory than a normal one. A row that cannot be read (not UTF-8, not
JSON, nested deeper than the parser recurses, a number longer than Python converts) is a reason, never an
exception, so that the caller counts it and goes on. Stdlib only.
"""

from __future__ import annotations

import fcntl
import json
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from engine.trainer.config import ConfigError, file_kind

MAX_ROW_BYTES = 1 << 20  # ~250k tokens of English: longer than any bucket a drafter trains on
MAX_ROW_TURNS = 1024  # the turns of one conversation; its templating renders every prefix (quadratic in turns)
SKIP_ROW_TOO_LONG = f"row longer than {MAX_ROW_BYTES >> 20} MiB"
SKIP_TOO_MANY_TURNS = f"more than {MAX_ROW_TURNS} turns"
SKIP_NOT_UTF8 = "not UTF-8"
SKIP_NOT_JSON = "not JSON"
SKIP_TOO_DEEP = "JSON nested too deeply"
SKIP_HUGE_NUMBER = "a number too long to read"
SKIP_CHUNK_BYTES = 1 << 16  # how a row past the limit is read through


class LoadingStopped(Exception):
    """A stop signal came while the data was being read or tokenized; the message says which."""


@dataclass(frozen=True)
class Row:
    lineno: int  # 1-based line of the file
    raw: bytes | None  # the line; None when it is longer than the limit (never held whole)
    size: int  # its length in bytes


class BadRow(Exception):
    """A row that cannot be used: ``reason`` is what it is counted under, ``detail`` says more for a person."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail or reason


def open_regular(path: str | Path) -> IO[bytes]:
    """``path`` opened for reading in binary; a ConfigError naming it when it is not a regular file or empty."""
    p = Path(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
    except OSError as exc:
        raise ConfigError(f"data: {p} cannot be read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"data: {p} is {file_kind(st.st_mode)}, not a regular file of JSON lines")
        if st.st_size == 0:
            raise ConfigError(f"data: {p} is empty: no conversations to read")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_rows(
    path: str | Path, *, max_bytes: int = MAX_ROW_BYTES, should_stop: Callable[[], str | None] | None = None
) -> Iterator[Row]:
    """The non-blank lines of ``path``, each at most ``max_bytes`` long or reported by its size only.
    ``should_stop`` (the name of a stop signal, or None) is asked before every row: LoadingStopped."""
    with open_regular(path) as f:
        lineno = 0
        while True:
            if should_stop is not None and (signal_name := should_stop()):
                raise LoadingStopped(f"stopped ({signal_name}) while reading {path}")
            line = f.readline(max_bytes + 1)
            if not line:
                return
            lineno += 1
            if line.endswith(b"\n") or len(line) <= max_bytes:
                if line.strip():
                    yield Row(lineno, line, len(line))
                continue
            size, blank = len(line), not line.strip()
            while not line.endswith(b"\n"):
                line = f.readline(SKIP_CHUNK_BYTES)
                if not line:
                    break
                size, blank = size + len(line), blank and not line.strip()
            if not blank:
                yield Row(lineno, None, size)


def parse_row(row: Row) -> Any:
    """The JSON value of ``row``; BadRow with the reason it cannot be read."""
    if row.raw is None:
        raise BadRow(SKIP_ROW_TOO_LONG, f"{SKIP_ROW_TOO_LONG} ({row.size} bytes)")
    try:
        text = row.raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRow(SKIP_NOT_UTF8, f"{SKIP_NOT_UTF8} (byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRow(SKIP_NOT_JSON, f"not JSON: {exc}") from None
    except RecursionError:
        raise BadRow(SKIP_TOO_DEEP) from None
    except ValueError:  # Python's int string limit: "Exceeds the limit (4300 digits) for integer string conversion"
        raise BadRow(SKIP_HUGE_NUMBER) from None


def check_turns(turns: list[Any]) -> None:
    """BadRow when a conversation has more turns than ``MAX_ROW_TURNS``."""
    if len(turns) > MAX_ROW_TURNS:
        raise BadRow(SKIP_TOO_MANY_TURNS, f"{SKIP_TOO_MANY_TURNS} ({len(turns)})")
