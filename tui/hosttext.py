"""Host text made safe for the viewer's terminal.

The training host is not trusted: a job chooses its own argv, thread names, log lines, exception messages and
directory names, and the agent relays them as sent. Written raw to a terminal, an ESC or C1 byte starts a control
sequence (a title change, a screen clear, an OSC 52 clipboard write); a newline splits a table row. Every
host-supplied string the dashboard draws or the human CLI prints goes through ``printable`` (one line) or
``printable_lines`` (newlines kept). A C0 control becomes one visible character of its own (``␛`` for ESC, ``⏎``
for a newline); what draws nothing or reorders what follows (a C1 control, a zero-width or direction character, a
line or paragraph separator, a lone surrogate) is shown as its escape (``\x9b``, ``\u200b``, ``\u202e``), so
``r\u200bm`` never reads as ``rm`` and a name says which character it was. ``printable_rendered`` keeps a styled
span over the characters it covered when an escape makes the text longer.

``TerminalFilter`` is the ``logs`` command's filter for a terminal: SGR colour sequences pass, every other control
sequence is neutralised; a sequence or a UTF-8 character cut by a chunk boundary waits for the next chunk.
"""

from __future__ import annotations

import codecs
import re
from itertools import accumulate
from typing import Any, Protocol, TypeVar

TAB = 0x09
NEWLINE = 0x0A
CARRIAGE_RETURN = 0x0D
ESC = 0x1B
NEWLINE_SIGN = "⏎"
# Drawn as nothing, or reordering what follows on screen: shown as escapes. Unicode's format characters (category
# Cf: zero-width space and joiners, direction marks, embeddings, overrides and isolates, the byte order mark, soft
# hyphen, invisible operators, tags), the line and paragraph separators, the blank fillers (Hangul, Khmer) and the
# combining grapheme joiner; written out, so the table does not depend on the interpreter's Unicode version.
_INVISIBLE: tuple[range, ...] = (
    range(0x80, 0xA0),  # C1 controls (0x85 NEL breaks a line, 0x9B is CSI on some terminals)
    range(0xAD, 0xAE),
    range(0x34F, 0x350),
    range(0x600, 0x606),
    range(0x61C, 0x61D),
    range(0x6DD, 0x6DE),
    range(0x70F, 0x710),
    range(0x890, 0x892),
    range(0x8E2, 0x8E3),
    range(0x115F, 0x1161),
    range(0x17B4, 0x17B6),
    range(0x180B, 0x1810),
    range(0x200B, 0x2010),
    range(0x2028, 0x202F),
    range(0x205F, 0x2070),
    range(0x3164, 0x3165),
    range(0xD800, 0xE000),  # lone surrogates (undecodable bytes kept by surrogateescape)
    range(0xFE00, 0xFE10),
    range(0xFEFF, 0xFF00),
    range(0xFFA0, 0xFFA1),
    range(0xFFF9, 0xFFFC),
    range(0x110BD, 0x110BE),
    range(0x110CD, 0x110CE),
    range(0x13430, 0x13441),
    range(0x1BCA0, 0x1BCA4),
    range(0x1D173, 0x1D17B),
    range(0xE0000, 0xE0080),
    range(0xE0100, 0xE01F0),
)


def escape_of(code: int) -> str:
    """The escape a character is shown as, as Python writes it: ``\x85``, ``\u200b``, ``\U000e0041``."""
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _table(keep: frozenset[int]) -> dict[int, str]:
    table: dict[int, str] = {}
    for code in range(0x20):
        table[code] = chr(0x2400 + code)  # the Control Pictures block: ␀ ␁ ... ␛ ... ␟
    table[NEWLINE] = NEWLINE_SIGN
    table[0x7F] = "\u2421"  # ␡
    for block in _INVISIBLE:
        for code in block:
            table[code] = escape_of(code)
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


class _HasSpans(_HasPlain, Protocol):
    spans: list[Any]


Rendered = TypeVar("Rendered", bound=_HasSpans)


def printable_rendered(text: Rendered, *, one_line: bool = False) -> Rendered:
    """A widget's finished rich Text with every control character it still holds made visible (newlines kept unless
    ``one_line``); each styled span keeps covering the characters it covered, escapes included. The net under the
    per-string calls, not a replacement: a host string's own newline must be made visible before it is joined with
    the widget's line breaks."""
    table = _ONE_LINE if one_line else _LINES
    plain = text.plain
    shown = plain.translate(table)
    if len(shown) == len(plain):
        text.plain = shown  # each sign one character: every span stays where it was
        return text
    ends = list(accumulate(len(table.get(ord(c), c)) if ord(c) in table else 1 for c in plain))
    starts = [0, *ends]  # the new offset where each old character begins (and the end of the text)
    spans = [s._replace(start=starts[s.start], end=starts[s.end]) for s in text.spans if s.end <= len(plain)]
    text.spans = []
    text.plain = shown
    text.spans = spans
    return text
