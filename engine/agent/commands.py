"""The agent's command table: name -> handler. Command modules register handlers with ``@handler("name")``.

A handler runs in its own thread, so it may block (a ``wait`` for a milestone, a ``stop`` grace period).
It returns the reply's ``result`` (a JSON-able dict) or raises ``CommandError`` with a sentence for
the user. Anything else it raises becomes an error reply carrying the exception's type and text.
This table imports only the server's types; engine/agent/main.py imports the command modules.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.agent.server import Handler

HANDLERS: dict[str, Handler] = {}


def handler(name: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        if name in HANDLERS:
            raise RuntimeError(f"two handlers for command {name!r}")
        HANDLERS[name] = fn
        return fn

    return register
