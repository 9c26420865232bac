"""Notices as plain text, for every app of the dashboard: their words are often the host's (a thread's exception,
a run's cause, a node's link error), and as markup ``[/data]`` would crash the app and ``[@click=...]`` become a
live action."""

from __future__ import annotations

from textual.app import App
from textual.notifications import SeverityLevel

from tui.hosttext import printable, printable_lines


class PlainNotices(App[int]):
    """``notify`` never turns markup on and shows host text with its controls made visible."""

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """``markup`` is accepted only to keep App's signature; it is never turned on."""
        del markup
        super().notify(
            printable_lines(message), title=printable(title), severity=severity, timeout=timeout, markup=False
        )
