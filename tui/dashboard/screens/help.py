"""Every key, what it does and why (from the binding table, with the user's remaps applied), and what the
training charts' loss and acc_i are."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Static

from tui.dashboard.keys import KEY_TABLE, display_key
from tui.dashboard.widgets.charts import ACC_HELP, LOSS_HELP, TAU_HELP


class HelpScreen(Screen[None]):
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 100; max-width: 95%; height: auto; max-height: 90%; border: thick $primary;
                            background: $surface; padding: 0 1; }
    HelpScreen #help-title { text-style: bold; color: $primary; }
    HelpScreen #help-foot { color: $text-muted; }
    HelpScreen #help-charts { margin-top: 1; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "close", "Close")]

    def __init__(self, keymap: dict[str, str]) -> None:
        super().__init__()
        self.keymap = keymap

    def rows(self) -> list[tuple[str, str, str]]:
        """(key, action, what it does) per binding, the user's remaps applied."""
        out = [(display_key(self.keymap.get(s.id, s.key)), s.description, s.tooltip) for s in KEY_TABLE]
        out.append(("ctrl+p", "Commands", "Command palette: every action above, searchable"))
        return out

    @staticmethod
    def charts_text() -> str:
        """What the training charts' numbers are."""
        return f"Charts\n{LOSS_HELP}\n{ACC_HELP}\n{TAU_HELP}"

    def table(self) -> Table:
        """Three columns; only the description wraps, under itself (a hanging indent), at any width."""
        grid = Table.grid(padding=(0, 2))
        grid.add_column(no_wrap=True)
        grid.add_column(no_wrap=True)
        grid.add_column(ratio=1, overflow="fold")
        for key, name, what in self.rows():
            grid.add_row(Text(key), Text(name), Text(what))
        return grid

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static("specdec-tui keys", id="help-title")
            with VerticalScroll():
                yield Static(self.table(), id="help-table")
                yield Static(self.charts_text(), id="help-charts", markup=False)
            yield Static(
                'Remap a key in ~/.config/specdec-tui/tui.toml, e.g. [keys] restart = "ctrl+r". Esc closes.',
                id="help-foot",
                markup=False,
            )

    def action_close(self) -> None:
        self.dismiss(None)
