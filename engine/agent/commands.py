"""The agent's command table: name -> handler. Modules register handlers with ``@handler("name")``.

A handler runs in its own thread, so it may block (a ``wait`` for a milestone, a ``stop`` grace period).
It returns the reply's ``result`` (a JSON-able dict) or raises ``CommandError`` with a sentence for
the user. Anything else it raises becomes an error reply carrying the exception's type and text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.agent.main import Agent

Handler = Callable[["Agent", "int | None", dict[str, Any]], dict[str, Any]]

HANDLERS: dict[str, Handler] = {}


class CommandError(Exception):
    """A command failed for a reason the user should read (bad argument, nothing to stop, ...)."""


def handler(name: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        if name in HANDLERS:
            raise RuntimeError(f"two handlers for command {name!r}")
        HANDLERS[name] = fn
        return fn

    return register
