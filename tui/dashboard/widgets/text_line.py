"""Small rendering helpers: a one-line text widget, and height tracking that avoids needless layouts.

A ``Static.update`` reflows the whole screen; at 10 flushes a second under a log burst that is most
of the frame time. These redraw in place and ask for a layout only when their row count changes.
"""

from __future__ import annotations

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget


class TextLine(Widget):
    """One row of text, redrawn without a layout pass."""

    DEFAULT_CSS = """
    TextLine { height: 1; width: 1fr; text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, text: Text | str = "", *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self._text = text if isinstance(text, Text) else Text(text)

    def set_text(self, text: Text | str) -> None:
        self._text = text if isinstance(text, Text) else Text(text)
        self.refresh()

    @property
    def text(self) -> Text:
        return self._text

    def render(self) -> RenderableType:
        return self._text


class RowTracking(Widget):
    """A widget with ``height: auto`` whose row count is known only when it renders."""

    _rows = -1

    def track_rows(self, text: Text) -> Text:
        rows = text.plain.count("\n") + 1
        if rows != self._rows:
            self._rows = rows
            self.call_after_refresh(self.refresh, layout=True)
        return text
