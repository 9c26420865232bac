"""Reading a TOML file the user (or anyone who can write to their config directory) wrote: never hang, never a
traceback.

Only a regular file is read (a FIFO would block the open and the read for good), at most ``MAX_TOML_BYTES``; a
value the parser cannot hold (an integer of thousands of digits, tables or arrays nested thousands deep) is
a ``TomlFileError`` like any syntax error: one line that names the file.
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MAX_TOML_BYTES = 1 << 20  # a config or theme file is a few KiB
SHOWN_VALUE_CHARS = 60  # how much of a rejected value an error message repeats


class TomlFileError(ValueError):
    """A TOML file that cannot be used: one line naming the file and why."""


def read_toml(path: Path | str, max_bytes: int = MAX_TOML_BYTES) -> dict[str, Any]:
    """The tables of the TOML file at ``path``; FileNotFoundError when there is none, TomlFileError (one line)
    when it is not a regular file, too big, unreadable or not TOML this parser can hold."""
    where = Path(path)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise TomlFileError(f"{where}: cannot read: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise TomlFileError(f"{where}: cannot read: not a regular file (a directory, a FIFO or a device)")
        if info.st_size > max_bytes:
            raise TomlFileError(f"{where}: {info.st_size} bytes, more than the {max_bytes} a TOML file here may hold")
        data = os.read(fd, max_bytes + 1)
    except OSError as exc:
        raise TomlFileError(f"{where}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise TomlFileError(f"{where}: more than the {max_bytes} bytes a TOML file here may hold")
    return parse_toml(data, where)


def parse_toml(data: bytes | str, where: Path | str) -> dict[str, Any]:
    """``data`` as TOML tables; TomlFileError (one line naming ``where``) for anything the parser refuses."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise TomlFileError(f"{where}: not valid TOML: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise TomlFileError(f"{where}: not valid TOML: {one_line(str(exc))}") from None
    except ValueError:  # an integer past Python's digit limit (int_max_str_digits)
        limit = getattr(sys, "get_int_max_str_digits", lambda: 4300)()
        raise TomlFileError(
            f"{where}: not valid TOML: a value too large to read (an integer of over {limit} digits)"
        ) from None
    except RecursionError:
        raise TomlFileError(f"{where}: not valid TOML: tables or arrays nested too deep to read") from None


def one_line(text: str, limit: int = 200) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def shown(value: Any) -> str:
    """A rejected value as an error message repeats it: its repr, cut to SHOWN_VALUE_CHARS."""
    try:
        text = repr(value)
    except ValueError:  # an int past the digit limit cannot even be written out
        return "an integer too long to write out"
    except RecursionError:
        return "a value nested too deep to write out"
    return text if len(text) <= SHOWN_VALUE_CHARS else text[: SHOWN_VALUE_CHARS - 1] + "…"
