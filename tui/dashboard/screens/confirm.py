"""A modal that asks before anything is signalled or started: returns the chosen choice id or None."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


@dataclass(frozen=True)
class Choice:
    id: str
    label: str
    variant: str = "default"  # Button variants: "default", "primary", "success", "warning", "error"
    key: str | None = None  # a single key that picks it


class ConfirmScreen(ModalScreen[str | None]):
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 80; max-width: 95%; height: auto; max-height: 90%; border: thick $primary;
                               background: $surface; padding: 1 2; }
    ConfirmScreen #confirm-title { text-style: bold; color: $text; margin-bottom: 1; }
    ConfirmScreen #confirm-body { color: $text; height: auto; margin-bottom: 1; }
    ConfirmScreen Horizontal { height: auto; align: right middle; }
    ConfirmScreen Button { margin-left: 2; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "cancel", "Cancel", show=False),
        Binding("n", "cancel", "No", show=False),
    ]

    def __init__(self, title: str, body: str, choices: list[Choice] | None = None) -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.choices = choices or [Choice("yes", "Yes", "error", "y"), Choice("no", "Cancel", "default", "n")]

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.title_text, id="confirm-title", markup=False)
            yield Static(self.body, id="confirm-body", markup=False)
            with Horizontal():
                for choice in self.choices:
                    label = f"{choice.label} ({choice.key})" if choice.key else choice.label
                    yield Button(label, id=f"choice-{choice.id}", variant=choice.variant)  # type: ignore[arg-type]

    def on_mount(self) -> None:
        # Focus the safe choice: a stray Enter must not signal anything.
        self.query_one(f"#choice-{self.choices[-1].id}", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        choice_id = (event.button.id or "").removeprefix("choice-")
        self.dismiss(None if choice_id == "no" else choice_id)

    def on_key(self, event: object) -> None:
        key = getattr(event, "key", None)
        for choice in self.choices:
            if choice.key and key == choice.key and choice.key != "n":
                getattr(event, "stop", lambda: None)()
                self.dismiss(choice.id)
                return

    def action_cancel(self) -> None:
        self.dismiss(None)
