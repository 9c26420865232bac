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
        key_style = self.get_component_rich_style("key-footer--key")
        text_style = self.get_component_rich_style("key-footer--description")
        out = Text(no_wrap=True, overflow="ellipsis")
        for spec in KEY_TABLE:
            if not spec.show:
                continue
            key = self.keymap.get(spec.id, spec.key).split(",")[0]
            out.append(f" {display_key(key)} ", style=key_style)
            out.append(f"{spec.description} ", style=text_style)
        out.append(" ^p ", style=key_style)
        out.append("palette", style=text_style)
        return out
