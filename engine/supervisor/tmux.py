"""The one place product code calls tmux.

Every call adds ``-L $SPECDEC_TMUX_SOCKET`` when that variable is set (tests use a private server;
production uses the default one, so a user can ``tmux attach -t <session>``).
``SPECDEC_NO_TMUX=1`` makes the supervisor behave as on a host without tmux (setsid fallback).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

SOCKET_ENV = "SPECDEC_TMUX_SOCKET"
DISABLE_ENV = "SPECDEC_NO_TMUX"
SESSION_PREFIX = "specdec-"
TMUX_TIMEOUT_S = 10.0
SERVER_RACE_RETRIES = 3


class TmuxError(RuntimeError):
    """tmux refused a command; the message carries tmux's own words."""


def available() -> bool:
    return shutil.which("tmux") is not None and os.environ.get(DISABLE_ENV, "") not in ("1", "true", "yes")


def base_argv() -> list[str]:
    argv = ["tmux"]
    sock = os.environ.get(SOCKET_ENV)
    if sock:
        argv += ["-L", sock]
    return argv


def run(*args: str, timeout_s: float = TMUX_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*base_argv(), *args],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def session_name(run_id: str) -> str:
    """tmux turns '.' and ':' in session names into '_': do it ourselves so the name we record is the real one."""
    return SESSION_PREFIX + re.sub(r"[.:]", "_", run_id)


def has_session(name: str) -> bool:
    # "=" asks for an exact match; without it tmux accepts a unique prefix.
    return run("has-session", "-t", f"={name}").returncode == 0


# tmux expands ``new-session -c DIR`` as a format (``#(cmd)`` runs cmd), so a user's directory never goes there: the
# pane starts here and shell_command changes directory itself. (tmux does not expand the shell command.)
PANE_START_DIR = "/"


def new_session(name: str, shell_command: str) -> None:
    """A detached session running shell_command, whose dead pane stays (remain-on-exit) so its status can be read.

    Every argument is fixed or validated (the name is a run id's): user text reaches tmux only inside shell_command,
    which tmux hands to the shell unexpanded; it must not end in ";", which tmux reads as a command separator.

    remain-on-exit is set in the same tmux invocation, before the server handles the child's exit.
    A server that is exiting (its last session just closed) refuses the call with "server exited
    unexpectedly": then no session was made, and a retry starts a fresh server.
    """
    if shell_command.endswith(";"):
        raise TmuxError("tmux would split a shell command that ends in ';'")
    words = ""
    for attempt in range(SERVER_RACE_RETRIES + 1):
        res = run(
            "new-session",
            "-d",
            "-s",
            name,
            "-x",
            "200",
            "-y",
            "50",
            "-c",
            PANE_START_DIR,
            shell_command,
            ";",
            "set-option",
            "-w",
            "-t",
            f"={name}:",
            "remain-on-exit",
            "on",
        )
        if res.returncode == 0:
            return
        words = (res.stderr or res.stdout).strip() or f"exit status {res.returncode}"
        if "server exited unexpectedly" not in words and "lost server" not in words:
            break
        if has_session(name):
            return  # it did start before this client lost its server
        time.sleep(0.05 * (attempt + 1))
    raise TmuxError(f"tmux new-session -s {name} failed: {words}")


def pane_state(name: str) -> dict[str, int | bool | None] | None:
    """{"pid", "dead", "dead_status", "dead_signal"} of the session's first pane; None when there is no such session.

    tmux can mark a pane dead (its pty closed) a moment before it has reaped the child: status and
    signal are None until then.
    """
    res = run(
        "display-message", "-p", "-t", f"={name}:", "#{pane_pid}|#{pane_dead}|#{pane_dead_status}|#{pane_dead_signal}"
    )
    if res.returncode != 0:
        return None
    parts = res.stdout.strip().split("|")
    try:
        return {
            "pid": int(parts[0]),
            "dead": parts[1] == "1",
            "dead_status": int(parts[2]) if len(parts) > 2 and parts[2] else None,
            "dead_signal": int(parts[3]) if len(parts) > 3 and parts[3] else None,
        }
    except (IndexError, ValueError):
        return None


def reap_children() -> None:
    """Make the server reap its exited children: tmux 3.3a sometimes misses a pane child's SIGCHLD (measured: 9 of
    30 panes stayed zombies with no #{pane_dead_status}); the next child it reaps (this run-shell's) reaps all."""
    run("run-shell", "true")


def dead_sessions() -> set[str]:
    """Sessions whose every pane has exited (remain-on-exit keeps them to read), in one call; empty without a
    server. A session with a live pane (one a user split off beside the run's, say) is not dead."""
    res = run("list-panes", "-a", "-F", "#{session_name}|#{pane_dead}")
    if res.returncode != 0:
        return set()
    dead: set[str] = set()
    alive: set[str] = set()
    for name, _, flag in (line.rpartition("|") for line in res.stdout.splitlines()):
        (dead if flag == "1" else alive).add(name)
    return dead - alive


def kill_session(name: str) -> bool:
    return run("kill-session", "-t", f"={name}").returncode == 0


def attach_command(name: str) -> list[str]:
    """The argv a person on the host runs to watch the run."""
    return [*base_argv(), "attach", "-t", f"={name}"]
