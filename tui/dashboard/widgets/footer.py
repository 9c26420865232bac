"""The key footer: every shown binding with its (remapped) key, drawn as one line of text.

Textual's ``Footer`` recomposes its key widgets whenever the active bindings change (every modal
push and pop); that restyling was most of the key-to-frame time. This one only re-renders.
"""

from __future__ import annotations

from typing import ClassVar

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from tui.dashboard.keys import KEY_TABLE, display_key

ALWAYS_WORDED = frozenset({"help", "quit"})


class KeyFooter(Widget):
    COMPONENT_CLASSES: ClassVar[set[str]] = {"key-footer--key", "key-footer--description"}
    DEFAULT_CSS = """
    KeyFooter { dock: bottom; height: 1; background: $panel; text-wrap: nowrap; text-overflow: ellipsis; }
    KeyFooter > .key-footer--key { color: $accent; text-style: bold; }
    KeyFooter > .key-footer--description { color: $text; }
    """

    def __init__(self, keymap: dict[str, str] | None = None, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.keymap = dict(keymap or {})

    def set_keymap(self, keymap: dict[str, str]) -> None:
        self.keymap = dict(keymap)
        self.refresh()

    def render(self) -> RenderableType:
        """Every shown key with its description; when that does not fit, each key with its short word (80 columns);
        when not even that fits, the keys alone but for ``? Help`` and ``q Quit``, which always keep their words (a
        newcomer's way in and out)."""
        key_style = self.get_component_rich_style("key-footer--key")
        text_style = self.get_component_rich_style("key-footer--description")
        shown = [(display_key(self.keymap.get(s.id, s.key).split(",")[0]), s) for s in KEY_TABLE if s.show]
        width = self.size.width
        full = sum(len(k) + len(s.description) + 3 for k, s in shown) + len(" ^p palette")
        short = sum(len(k) + len(s.short or s.description) + 2 for k, s in shown)
        out = Text(no_wrap=True, overflow="ellipsis")
        if not width or full <= width:
            for key, spec in shown:
                out.append(f" {key} ", style=key_style)
                out.append(f"{spec.description} ", style=text_style)
            out.append(" ^p ", style=key_style)
            out.append("palette", style=text_style)
        elif short <= width:
            for key, spec in shown:
                out.append(f" {key} ", style=key_style)
                out.append(spec.short or spec.description, style=text_style)
        else:
            for key, spec in shown:
                out.append(f" {key} ", style=key_style)
                if spec.id in ALWAYS_WORDED:
                    out.append(f"{spec.description} ", style=text_style)
            out.append(" ^p ", style=key_style)
            out.append("palette", style=text_style)
        return out
