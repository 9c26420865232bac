"""The agent's command table: name -> handler. Command modules register handlers with ``@handler("name")``.

A handler runs in its own thread, so it may block (a ``wait`` for a milestone, a ``stop`` grace period).
It returns the reply's ``result`` (a JSON-able dict) or raises ``CommandError`` with a sentence for
the user. Anything else it raises becomes an error reply carrying the exception's type and text.
This table imports only the server's types (and the run records, for ``run_dir_arg``, which every command
naming a run shares); engine/agent/main.py imports the command modules.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import protocol
from engine.agent.server import Agent, CommandError, Handler
from engine.supervisor import records

HANDLERS: dict[str, Handler] = {}


def handler(name: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        if name in HANDLERS:
            raise RuntimeError(f"two handlers for command {name!r}")
        HANDLERS[name] = fn
        return fn

    return register


def run_dir_arg(agent: Agent, args: dict[str, Any]) -> Path:
    """The run a command names (``run_id``), else the current run; CommandError for a bad or unknown id."""
    run_id = args.get("run_id")
    root = Path(agent.run_root)
    if run_id is not None:
        try:
            run_dir = records.run_dir_for(root, run_id)
        except protocol.RunIdError as exc:
            raise CommandError(str(exc)) from exc
        if not run_dir.is_dir():
            raise CommandError(f"no run {run_id!r} under {root}")
        return run_dir
    current = records.current_run_dir(root)
    if current is None:
        raise CommandError(records.current_refusal(root) or f"no run under {root} yet (nothing launched)")
    return current
