"""The log tail: a byte-offset-deduplicating log model and a ``Log``-based view of it.

The model takes the agent's ``log`` events (offset, inode, data) and never takes a byte twice:
a resent chunk (after a reconnect) is cut at the offset it already has. It strips ANSI escapes,
collapses carriage-return progress bars to their last state, and keeps a bounded ring of lines.
The view follows the end until the user scrolls up, then counts the lines that arrive meanwhile.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from typing import ClassVar

from rich.highlighter import Highlighter
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.css.query import NoMatches
from textual.geometry import Size
from textual.reactive import reactive
from textual.widgets import Input, Log

from engine.protocol import decode_log_data
from tui.dashboard.widgets.text_line import TextLine
from tui.hosttext import printable

DEFAULT_MAX_LINES = 20_000
MAX_PARTIAL_BYTES = 256 * 1024

_ANSI_RE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]")
ERROR_LINE_RE = re.compile(
    r"Traceback \(most recent call last\)|Exception|\b\w*Error\b:|CUDA error|\bNaN\b|\bnan\b|\bInf\b loss"
)


def clean_line(raw: str) -> str:
    """One display line: ANSI escapes removed, a ``\\r``-redrawn progress bar reduced to its last state (what is left
    of other control characters is made visible by the caller)."""
    line = _ANSI_RE.sub("", raw).rstrip("\r")
    if "\r" in line:
        segments = [seg for seg in line.split("\r") if seg]
        line = segments[-1] if segments else ""
    return line


def is_error_line(line: str) -> bool:
    return ERROR_LINE_RE.search(line) is not None


class LogModel:
    """The lines of the run's ``output.log`` as the dashboard knows them.

    ``next_offset`` is the byte after the last byte taken in; a ``log`` event that starts below it is
    trimmed (or ignored), so a stream resumed from an older offset cannot double a line.
    """

    def __init__(self, max_lines: int = DEFAULT_MAX_LINES) -> None:
        self.max_lines = max_lines
        self.lines: deque[str] = deque(maxlen=max_lines)
        self.inode: int | None = None
        self.next_offset: int | None = None
        self.total_lines = 0  # complete lines taken in since the start (or the last reset)
        self.duplicate_bytes = 0  # bytes received twice and dropped
        self.gap_bytes = 0  # bytes the stream skipped (offset jumped ahead): shown as a marker line
        self.resets = 0
        self.marker_lines = 0  # lines the model wrote itself (resets, gaps), not from the file
        self._partial = b""
        self._unflushed: deque[str] = deque(maxlen=max_lines)
        self.unflushed_overflow = 0  # lines that left the ring before the view drew them (a burst)

    def feed(self, offset: int, inode: int | None, data: str) -> int:
        """Take one ``log`` event; returns how many complete new lines it produced."""
        chunk = decode_log_data(data)
        if inode is not None and self.inode is not None and inode != self.inode:
            self.reset(inode, offset, "rotated")
        if self.inode is None:
            self.inode = inode
        if self.next_offset is None:
            self.next_offset = offset
        end = offset + len(chunk)
        if end <= self.next_offset:
            self.duplicate_bytes += len(chunk)
            return 0
        added: list[str] = []
        if offset < self.next_offset:
            cut = self.next_offset - offset
            self.duplicate_bytes += cut
            chunk = chunk[cut:]
        elif offset > self.next_offset:
            gap = offset - self.next_offset
            self.gap_bytes += gap
            added.extend(self._split(b"", final=True))
            added.append(f"… {gap} bytes not received (stream resumed at byte {offset}) …")
            self.marker_lines += 1
        self.next_offset = end
        added.extend(self._split(chunk))
        self._take(added)
        return len(added)

    def reset(self, inode: int | None, offset: int, reason: str) -> None:
        """The agent restarted following (a new run's log, rotation, truncation)."""
        pending = self._split(b"", final=True)
        self.resets += 1
        self.inode = inode
        self.next_offset = offset
        self.marker_lines += 1
        self._take([*pending, f"── log {reason}: following from byte {offset} ──"])

    def _split(self, chunk: bytes, final: bool = False) -> list[str]:
        data = self._partial + chunk if self._partial else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            whole, self._partial = b"", data
        else:
            # Only complete lines are decoded, so a multi-byte character split across chunks stays whole.
            whole, self._partial = data[:cut], data[cut + 1 :]
        if final and self._partial:
            whole = whole + b"\n" + self._partial if cut >= 0 else self._partial
            self._partial = b""
            cut = 0
        elif len(self._partial) > MAX_PARTIAL_BYTES:
            # A progress bar redrawn with \r for hours: keep only its latest state.
            self._partial = self._partial.rsplit(b"\r", 1)[-1][-MAX_PARTIAL_BYTES:]
        if cut < 0:
            return []
        parts = whole.decode("utf-8", "replace").split("\n")
        return [printable(clean_line(p) if ("\x1b" in p or "\r" in p) else p) for p in parts]

    def _take(self, lines: list[str]) -> None:
        if not lines:
            return
        self.total_lines += len(lines)
        self.lines.extend(lines)
        overflow = len(self._unflushed) + len(lines) - self.max_lines
        if overflow > 0:
            self.unflushed_overflow += min(overflow, len(self._unflushed))
        self._unflushed.extend(lines)

    def add_lines(self, lines: list[str]) -> None:
        """Take whole lines another model already cut and cleaned (the merged log of several nodes)."""
        self._take(lines)

    def take_unflushed(self) -> list[str]:
        out = list(self._unflushed)
        self._unflushed.clear()
        return out

    def matching(self, needle: str) -> list[str]:
        if not needle:
            return list(self.lines)
        low = needle.lower()
        return [line for line in self.lines if low in line.lower()]


class _TailHighlighter(Highlighter):
    """Colours error lines and filter matches with the theme's styles (component classes)."""

    def __init__(self, tail: LogTail) -> None:
        self._tail = tail

    def highlight(self, text: Text) -> None:
        plain = text.plain
        if is_error_line(plain):
            text.stylize(self._tail.get_component_rich_style("log-tail--error"))
        elif plain.startswith(("── log ", "… ")):
            text.stylize(self._tail.get_component_rich_style("log-tail--marker"))
        needle = self._tail.filter_text
        if needle:
            low = plain.lower()
            style = self._tail.get_component_rich_style("log-tail--match")
            start = low.find(needle.lower())
            while start >= 0:
                text.stylize(style, start, start + len(needle))
                start = low.find(needle.lower(), start + len(needle))


class LogTail(Log):
    """A ``Log`` that follows the end until the user scrolls up, then counts pending lines."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {"log-tail--error", "log-tail--match", "log-tail--marker"}
    DEFAULT_CSS = """
    LogTail > .log-tail--error { color: $error; text-style: bold; }
    LogTail > .log-tail--match { background: $accent 40%; }
    LogTail > .log-tail--marker { color: $text-muted; text-style: italic; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("end", "follow", "Follow", show=False)]

    pending = reactive(0)
    following = reactive(True)

    def __init__(self, max_lines: int = DEFAULT_MAX_LINES, *, id: str | None = None) -> None:
        super().__init__(highlight=True, max_lines=max_lines, auto_scroll=False, id=id)
        self.highlighter = _TailHighlighter(self)
        self.filter_text = ""
        self._programmatic = False

    def append(self, lines: Iterable[str]) -> int:
        wanted = list(lines)
        if self.filter_text:
            low = self.filter_text.lower()
            wanted = [line for line in wanted if low in line.lower()]
        if not wanted:
            return 0
        self._append_lines(wanted)
        if self.following:
            self._scroll_to_end()
        else:
            self.pending += len(wanted)
        return len(wanted)

    def _append_lines(self, lines: list[str]) -> None:
        """``Log.write_lines`` without its per-write width thread: a burst brings 10k lines per flush.

        Uses Log's internals (textual is pinned exactly); width is estimated with ``len``.
        """
        if self.max_lines is not None and len(lines) > self.max_lines:
            lines = lines[-self.max_lines :]
        self._lines.extend(lines)
        widest = max(map(len, lines))
        if widest > self._width:
            self._width = widest
        removed = 0
        if self.max_lines is not None and len(self._lines) > self.max_lines:
            removed = len(self._lines) - self.max_lines
            self._prune_max_lines()
        self.virtual_size = Size(self._width, len(self._lines))
        if removed and not self.following:
            # Keep the lines the reader is looking at in place while the top of the ring is dropped.
            self._programmatic = True
            try:
                self.scroll_to(y=max(0, self.scroll_y - removed), animate=False, immediate=True)
            finally:
                self._programmatic = False
        self.refresh()

    def show_lines(self, lines: list[str], filter_text: str) -> None:
        """Replace the content (a new filter): follow the end again."""
        self.filter_text = filter_text
        self._programmatic = True
        try:
            self.clear()
            if lines:
                self._append_lines(lines)
        finally:
            self._programmatic = False
        self.action_follow()

    def _scroll_to_end(self) -> None:
        self._programmatic = True
        try:
            self.scroll_end(animate=False, immediate=True, x_axis=False)
        finally:
            self._programmatic = False

    def action_follow(self) -> None:
        self.following = True
        self.pending = 0
        self._scroll_to_end()

    def on_resize(self, _event: events.Resize) -> None:
        """A pane that changed height (the panes above it grew or shrank) keeps a follower at the end."""
        if self.following:
            self.call_after_refresh(self._scroll_to_end)

    def watch_scroll_y(self, old_value: float, new_value: float) -> None:
        super().watch_scroll_y(old_value, new_value)
        if self._programmatic:
            return
        # Up, and short of the end: the reader scrolled. A taller pane pulls the position up to the new end.
        if new_value < old_value and new_value < self.max_scroll_y:
            self.following = False
        elif self.max_scroll_y > 0 and new_value >= self.max_scroll_y:
            self.following = True
            self.pending = 0

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self.refresh()


class LogPane(Vertical):
    """Status line (following / paused with pending count / filter), the tail, and the filter input.

    The filter box takes the status line's row while it is open (one row, no border), so opening and closing it
    never resizes the tail: that resize was the costliest key under a log burst (the whole tail re-rendered).
    """

    DEFAULT_CSS = """
    LogPane { height: 1fr; border: round $panel-lighten-2; border-title-color: $text-muted; }
    LogPane > #log-status { height: 1; color: $text-muted; padding: 0 1; }
    LogPane > #log-status.-paused { color: $warning; }
    LogPane > LogTail { height: 1fr; }
    LogPane > #log-filter, LogPane > #log-filter:focus {
        display: none; dock: top; height: 1; border: none; padding: 0 1; background: $boost;
    }
    LogPane.-filtering > #log-filter { display: block; }
    LogPane.-filtering > #log-status { display: none; }
    """

    def __init__(self, model: LogModel, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model = model
        self.border_title = "log"

    def compose(self) -> ComposeResult:
        yield TextLine("", id="log-status")
        yield LogTail(self.model.max_lines, id="log-tail")
        # After the tail in focus order (a hidden box must not take the first focus), docked to the top row.
        yield Input(placeholder="filter the log (Enter applies, Esc cancels, empty shows all)", id="log-filter")

    @property
    def tail(self) -> LogTail:
        return self.query_one(LogTail)

    def on_mount(self) -> None:
        tail = self.tail
        self.watch(tail, "pending", self._refresh_status, init=False)
        self.watch(tail, "following", self._refresh_status, init=False)
        self._refresh_status()

    def flush(self) -> int:
        """Draw the lines the model took in since the last flush."""
        lines = self.model.take_unflushed()
        shown = self.tail.append(lines) if lines else 0
        self._refresh_status()
        return shown

    def open_filter(self) -> None:
        box = self.query_one("#log-filter", Input)
        box.value = self.tail.filter_text
        self.add_class("-filtering")
        box.focus()

    @property
    def filtering(self) -> bool:
        """The filter box is open."""
        return self.has_class("-filtering")

    def apply_filter(self, text: str) -> None:
        self.remove_class("-filtering")
        # Every line the model holds is redrawn here, the ones not flushed yet too: the next flush must not
        # append those a second time.
        self.model.take_unflushed()
        self.tail.show_lines(self.model.matching(text), text)
        self.tail.focus()
        self._refresh_status()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.apply_filter(event.value.strip())

    def on_key(self, event: object) -> None:
        key = getattr(event, "key", None)
        if key == "escape" and self.filtering:
            self.remove_class("-filtering")
            self.tail.focus()
            getattr(event, "stop", lambda: None)()

    def _refresh_status(self, *_: object) -> None:
        try:
            tail = self.tail
            status = self.query_one("#log-status", TextLine)
        except NoMatches:
            return  # being torn down

        model = self.model
        parts: list[str] = []
        if tail.following:
            parts.append("following")
        else:
            parts.append(f"paused: {tail.pending} new line{'s' if tail.pending != 1 else ''} (f or End follows)")
        parts.append(f"{model.total_lines} lines")
        if tail.filter_text:
            parts.append(f"filter {tail.filter_text!r}: {tail.line_count} shown")
        if model.gap_bytes:
            parts.append(f"{model.gap_bytes} bytes missed")
        status.set_text(Text(" · ".join(parts)))
        status.set_class(not tail.following, "-paused")
