"""Every thread's stack of the live run, scrollable."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


class StacksScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    StacksScreen { align: center middle; }
    StacksScreen > Vertical { width: 95%; height: 90%; border: thick $primary; background: $surface; }
    StacksScreen #stacks-title { text-style: bold; padding: 0 1; background: $panel; }
    StacksScreen VerticalScroll { height: 1fr; padding: 0 1; }
    StacksScreen #stacks-text { width: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "close", "Close")]

    def __init__(self, method: str, text: str) -> None:
        super().__init__()
        self.method = method
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(f"thread stacks ({self.method}) - Esc closes", id="stacks-title", markup=False)
            with VerticalScroll(id="stacks-scroll"):
                yield Static(self.text or "(no stacks returned)", id="stacks-text", markup=False)

    def on_mount(self) -> None:
        self.query_one("#stacks-scroll").focus()

    def action_close(self) -> None:
        self.dismiss(None)
