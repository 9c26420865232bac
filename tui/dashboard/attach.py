"""Where "attach" goes when the dashboard itself runs inside tmux.

tmux refuses a client whose terminal is one of its own panes ("sessions should be nested with care").
So when the run's tmux server is the one this dashboard's pane belongs to, the current client is
switched to the run's session (``switch-client``; ``switch-client -l`` comes back); for any other server
(another socket, a container, a remote host) the attach command runs in this terminal with $TMUX unset.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass

ATTACH_VERBS = ("attach-session", "attach", "a")


@dataclass(frozen=True)
class HerePlan:
    argv: list[str]
    hands_over_terminal: bool  # True: run under App.suspend() until it exits; False: returns at once
    note: str  # what the user sees afterwards


def outer_socket(tmux_env: str | None = None) -> str | None:
    """The socket path of the tmux server this process runs inside ($TMUX is "path,pid,session"), or None."""
    value = os.environ.get("TMUX") if tmux_env is None else tmux_env
    if not value:
        return None
    return value.split(",", 1)[0] or None


def _local_tmux(argv: list[str]) -> tuple[list[str], str] | None:
    """(server options such as ["-L", name], session) when ``argv`` is a `tmux ... attach-session -t S` run here."""
    if not argv or os.path.basename(argv[0]) != "tmux":
        return None
    verb = next((i for i, a in enumerate(argv) if a in ATTACH_VERBS), None)
    if verb is None or "-t" not in argv[verb:]:
        return None
    target = argv.index("-t", verb)
    if target + 1 >= len(argv):
        return None
    return argv[1:verb], argv[target + 1]


def server_socket(server_opts: list[str]) -> str | None:
    """The socket path of the tmux server ``tmux SERVER_OPTS`` talks to (None when no server answers)."""
    try:
        done = subprocess.run(
            ["tmux", *server_opts, "display-message", "-p", "#{socket_path}"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    path = done.stdout.strip()
    return path if done.returncode == 0 and path else None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def plan_here(argv: list[str], tmux_env: str | None = None) -> HerePlan:
    """How "Use this terminal" attaches ``argv`` (from Transport.attach_argv) when $TMUX may be set."""
    outer = outer_socket(tmux_env)
    if outer is None:
        return HerePlan(argv, True, "")
    local = _local_tmux(argv)
    if local is not None:
        server_opts, session = local
        inner = server_socket(server_opts)
        if inner is not None and _same_file(inner, outer):
            switch = ["tmux", *server_opts, "switch-client", "-t", session]
            note = f"this tmux client now shows {session}; the dashboard keeps running: switch-client -l (prefix L)"
            return HerePlan(switch, False, note)
    # Another server: not nesting in tmux's sense, but a client that inherits $TMUX may still refuse.
    return HerePlan(["env", "-u", "TMUX", *argv], True, "")
