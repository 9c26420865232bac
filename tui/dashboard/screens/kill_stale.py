"""Kill stale GPU holders: list exactly what will be signalled (from a dry run), then confirm.

The targets sent on confirm are the (pid, create_time) pairs shown here and nothing else; the
agent re-checks each identity before it signals, so a reused PID is never hit.
"""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Static

from engine import protocol


def targets_of(candidates: list[protocol.HolderInfo]) -> list[list[Any]]:
    """The exact [pid, create_time] pairs to signal: resolved candidates with a known identity."""
    return [[c.pid, c.create_time] for c in candidates if c.resolved and c.create_time is not None]


class KillStaleScreen(ModalScreen[list[list[Any]] | None]):
    DEFAULT_CSS = """
    KillStaleScreen { align: center middle; }
    KillStaleScreen > Vertical { width: 110; max-width: 95%; height: auto; max-height: 90%;
                                  border: thick $error; background: $surface; padding: 1 2; }
    KillStaleScreen #kill-title { text-style: bold; color: $error; }
    KillStaleScreen #kill-note { color: $text-muted; margin-bottom: 1; }
    KillStaleScreen DataTable { height: auto; max-height: 20; margin-bottom: 1; }
    KillStaleScreen Horizontal { height: auto; align: right middle; }
    KillStaleScreen Button { margin-left: 2; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,n", "cancel", "Cancel", show=False)]

    def __init__(self, candidates: list[protocol.HolderInfo]) -> None:
        super().__init__()
        self.candidates = candidates
        self.targets = targets_of(candidates)

    def compose(self) -> ComposeResult:
        skipped = len(self.candidates) - len(self.targets)
        with Vertical():
            if self.targets:
                title = f"Signal these {len(self.targets)} process(es) holding GPUs outside the run?"
            else:
                title = "No stale GPU holder can be signalled"
            yield Static(title, id="kill-title", markup=False)
            note = "SIGTERM, then SIGKILL after the grace period; each PID's start time is re-checked first."
            if skipped:
                note += (
                    f" {skipped} holder(s) without a visible identity (NVML host PIDs) are listed but not signalled."
                )
            yield Static(note, id="kill-note", markup=False)
            yield DataTable(id="kill-table", cursor_type="row", zebra_stripes=False)
            with Horizontal():
                if self.targets:
                    yield Button(f"Signal {len(self.targets)} [y]", id="kill-yes", variant="error")
                yield Button("Cancel [n]", id="kill-no", variant="default")

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns("PID", "user", "GPUs", "GPU mem", "state", "age", "command")
        for cand in self.candidates:
            used, age = cand.used_mib, cand.age_s
            table.add_row(
                str(cand.pid),
                cand.user or "?",
                ",".join(str(g) for g in cand.gpus) or "?",
                f"{used:.0f} MiB" if used is not None else "?",
                cand.state or "?",
                f"{age:.0f}s" if age is not None else "?",
                (cand.cmd or "(not visible)")[:60],
                key=str(cand.pid),
            )
        self.query_one("#kill-no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(self.targets if event.button.id == "kill-yes" else None)

    def on_key(self, event: object) -> None:
        if getattr(event, "key", None) == "y" and self.targets:
            getattr(event, "stop", lambda: None)()
            self.dismiss(self.targets)

    def action_cancel(self) -> None:
        self.dismiss(None)
