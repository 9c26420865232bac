"""Host text made safe for the viewer's terminal.

The training host is not trusted: a job chooses its own argv, thread names, log lines, exception messages and
directory names, and the agent relays them as sent. Written raw to a terminal, an ESC or C1 byte starts a control
sequence (a title change, a screen clear, an OSC 52 clipboard write); a newline splits a table row. Every
host-supplied string the dashboard draws or the human CLI prints goes through ``printable`` (one line) or
``printable_lines`` (newlines kept). Each control character becomes one visible character of its own (``␛`` for
ESC, ``⏎`` for a newline, ``�`` for a C1 control or a lone surrogate), so a string keeps its length and a styled
span over it stays where it was.

``TerminalFilter`` is the ``logs`` command's filter for a terminal: SGR colour sequences pass, every other control
sequence is neutralised; a sequence or a UTF-8 character cut by a chunk boundary waits for the next chunk.
"""

from __future__ import annotations

import codecs
import re
from typing import Protocol, TypeVar

TAB = 0x09
NEWLINE = 0x0A
CARRIAGE_RETURN = 0x0D
ESC = 0x1B
NEWLINE_SIGN = "⏎"
UNPRINTABLE_SIGN = "\ufffd"
# Characters that are not controls but still break a line or reorder what follows it on screen.
_LINE_BREAKS = (0x85, 0x2028, 0x2029)
_BIDI_CONTROLS = (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)


def _table(keep: frozenset[int]) -> dict[int, str]:
    table: dict[int, str] = {}
    for code in range(0x20):
        table[code] = chr(0x2400 + code)  # the Control Pictures block: ␀ ␁ ... ␛ ... ␟
    table[NEWLINE] = NEWLINE_SIGN
    table[0x7F] = "\u2421"  # ␡
    for code in (*range(0x80, 0xA0), *_LINE_BREAKS, *_BIDI_CONTROLS, *range(0xD800, 0xE000)):
        table[code] = UNPRINTABLE_SIGN if code not in _LINE_BREAKS else NEWLINE_SIGN
    for code in keep:
        table.pop(code, None)
    return table


_ONE_LINE = _table(frozenset({TAB}))
_LINES = _table(frozenset({TAB, NEWLINE}))


def printable(text: object) -> str:
    """``text`` as one line the terminal draws literally: every control character a visible sign of one character."""
    return str(text).translate(_ONE_LINE)


def printable_lines(text: object) -> str:
    """Like ``printable``, with newlines kept (a traceback, a stack dump, a block of log lines)."""
    return str(text).replace("\r\n", "\n").translate(_LINES)


# ESC [ params intermediates final: a CSI sequence. Only SGR (final "m", digits ; and : as parameters) passes.
_SGR = re.compile(r"\x1b\[[0-9;:]*m")
# A sequence that may still be completed by the next chunk: ESC, ESC [ with parameters, ESC ] or P with no end yet.
_UNFINISHED = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|[\]PX^_][^\x07\x1b]*)?\Z")
UNFINISHED_HOLD_CHARS = 256  # a longer unfinished sequence is not colour: it is neutralised as it stands


class TerminalFilter:
    """Bytes of a log for a terminal: SGR colour, tab, newline and carriage return pass; every other control
    character (so every other ESC sequence: OSC title and clipboard writes, screen clears, cursor moves) becomes
    its visible sign."""

    _keep = _table(frozenset({TAB, NEWLINE, CARRIAGE_RETURN, ESC}))

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""

    def feed(self, data: bytes) -> bytes:
        text = self._held + self._decoder.decode(data)
        self._held = ""
        tail = _UNFINISHED.search(text)
        if tail is not None and len(text) - tail.start() <= UNFINISHED_HOLD_CHARS:
            text, self._held = text[: tail.start()], text[tail.start() :]
        return self._render(text)

    def flush(self) -> bytes:
        text = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return self._render(text)

    def _render(self, text: str) -> bytes:
        out: list[str] = []
        at = 0
        for match in _SGR.finditer(text):
            out.append(self._neutral(text[at : match.start()]))
            out.append(match.group())
            at = match.end()
        out.append(self._neutral(text[at:]))
        return "".join(out).encode("utf-8", "replace")

    def _neutral(self, text: str) -> str:
        return text.translate(self._keep).replace("\x1b", "\u241b")


class _HasPlain(Protocol):
    plain: str


Rendered = TypeVar("Rendered", bound=_HasPlain)


def printable_rendered(text: Rendered, *, one_line: bool = False) -> Rendered:
    """A widget's finished rich Text with every control character it still holds made visible (newlines kept unless
    ``one_line``); its styled spans stay where they were. The net under the per-string calls, not a replacement:
    a host string's own newline must be made visible before it is joined with the widget's line breaks."""
    text.plain = printable(text.plain) if one_line else printable_lines(text.plain)
    return text
