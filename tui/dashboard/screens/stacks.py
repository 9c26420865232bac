"""Every thread's stack of the live run, scrollable; opens at once with "dumping stacks…" until the reply."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

PENDING_TEXT = "dumping stacks…"


class StacksScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    StacksScreen { align: center middle; }
    StacksScreen > Vertical { width: 95%; height: 90%; border: thick $primary; background: $surface; }
    StacksScreen #stacks-title { text-style: bold; padding: 0 1; background: $panel; }
    StacksScreen VerticalScroll { height: 1fr; padding: 0 1; }
    StacksScreen #stacks-text { width: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "close", "Close")]

    def __init__(self, method: str | None = None, text: str = "") -> None:
        """``method`` None: the dump was asked for and has not come back yet."""
        super().__init__()
        self.method = method
        self.text = text
        # Kept, not queried: the reply can arrive after compose() but before the widgets are mounted.
        self._title_widget = Static(self._title(), id="stacks-title", markup=False)
        self._text_widget = Static(self._body(), id="stacks-text", markup=False)

    def _title(self) -> str:
        return f"thread stacks ({self.method or PENDING_TEXT}) - Esc closes"

    def _body(self) -> str:
        if self.method is None:
            return PENDING_TEXT
        return self.text or "(no stacks returned)"

    def compose(self) -> ComposeResult:
        with Vertical():
            yield self._title_widget
            with VerticalScroll(id="stacks-scroll"):
                yield self._text_widget

    def on_mount(self) -> None:
        self.query_one("#stacks-scroll").focus()

    def show(self, method: str, text: str) -> None:
        """The reply arrived: replace the pending text with the dump (or with why there is none)."""
        self.method, self.text = method, text
        self._title_widget.update(self._title())
        self._text_widget.update(self._body())

    def action_close(self) -> None:
        self.dismiss(None)
