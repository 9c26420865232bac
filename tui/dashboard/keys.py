"""The dashboard's key bindings as one table.

Every binding has an id (remap it in ``<config dir>/tui.toml``: ``[keys]`` ``restart = "ctrl+r"``),
a description (footer, help screen, command palette) and a tooltip (the longer explanation).
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.binding import Binding


@dataclass(frozen=True)
class KeySpec:
    id: str
    key: str
    action: str
    description: str
    tooltip: str
    show: bool = True
    short: str = ""  # the footer's word when the descriptions do not fit (80 columns); empty: the description


KEY_TABLE: tuple[KeySpec, ...] = (
    KeySpec(
        "launch", "l", "launch", "Launch", "Start the profile's command under supervision on the target", short="Run"
    ),
    KeySpec(
        "restart",
        "r",
        "restart",
        "Restart",
        "Stop the run (after you confirm), then launch the same command",
        short="Rerun",
    ),
    KeySpec("stop", "s", "stop", "Stop", "Stop the run after you confirm: SIGTERM to its process group, then SIGKILL"),
    KeySpec(
        "kill_stale",
        "k",
        "kill_stale",
        "Kill stale",
        "List the processes holding GPUs outside this run, then signal exactly those after you confirm",
        short="Stale",
    ),
    KeySpec(
        "attach",
        "a",
        "attach",
        "Attach",
        "Hand this terminal to the run's tmux session; detach to come back",
        short="Tmux",
    ),
    KeySpec("stacks", "d", "stacks", "Stacks", "Dump every thread's stack of the live run", short="Stack"),
    KeySpec(
        "serve_check",
        "v",
        "serve_check",
        "Serve check",
        "Serve the run's newest checkpoint through vLLM with its target on the held-out prompts; vLLM's τ shows "
        "beside the trained one when it is done; during a live run it asks first ($SPECDEC_VLLM_PYTHON on the host "
        "names vLLM's interpreter)",
        show=False,
    ),
    KeySpec(
        "runs",
        "p",
        "runs",
        "Past runs",
        "List past and current runs; the highlighted one shows why it ended (its cause) and its log tail",
        show=False,
    ),
    KeySpec("filter", "slash", "filter", "Filter", "Filter the log tail (empty filter shows everything)", short="Grep"),
    KeySpec("follow", "f", "follow", "Follow", "Jump to the end of the log and follow new lines", short="Tail"),
    KeySpec("theme", "t", "next_theme", "Theme", "Switch to the next colour theme (the choice is saved)"),
    KeySpec("help", "question_mark", "help", "Help", "Show every key and what it does"),
    KeySpec("quit", "q", "quit_dashboard", "Quit", "Leave the dashboard; the run keeps running on the target"),
)


def bindings() -> list[Binding]:
    return [
        Binding(spec.key, spec.action, spec.description, show=spec.show, id=spec.id, tooltip=spec.tooltip)
        for spec in KEY_TABLE
    ]


def valid_keymap(keymap: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Keep remaps of known binding ids; return (keymap, complaints about the rest)."""
    known = {spec.id for spec in KEY_TABLE}
    good = {k: v for k, v in keymap.items() if k in known and v.strip()}
    bad = [f"unknown key binding id {k!r} (known: {', '.join(sorted(known))})" for k in keymap if k not in known]
    return good, bad


def display_key(key: str) -> str:
    return {"slash": "/", "question_mark": "?"}.get(key, key)
