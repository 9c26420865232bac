"""The header: target (with its pct hop), connection state and round trip, run id and run state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rich.console import RenderableType
from rich.style import Style
from rich.text import Text
from textual.widget import Widget

from tui.hosttext import printable_rendered

STATE_MARKS = {
    "connected": ("●", "ok"),
    "connecting": ("◌", "warn"),
    "reconnecting": ("◌", "warn"),
    "disconnected": ("✗", "bad"),
    "failed": ("✗", "bad"),
}
RUN_STATE_CLASS = {
    "running": "ok",
    "starting": "warn",
    "exited": "muted",
    "stopped": "muted",
    "failed": "bad",
    "vanished": "bad",
    "rebooted": "bad",
}


@dataclass
class HeaderModel:
    target: str = "?"
    hostname: str | None = None
    state: str = "connecting"
    detail: str | None = None
    attempt: int | None = None
    rtt_ms: float | None = None
    run_id: str | None = None
    run_state: str | None = None
    restarts: str | None = None  # "restarts 2/3 (crash, oom)" under a restart policy (tui/restarts.py)
    restarted: bool = False  # at least one restart happened: shown as a warning
    failed_rank: str | None = None  # "rank 1 (node 1)": the torchrun rank that failed first, when the host named it
    simulated: bool = False
    readonly: bool = False  # watching only: no key acts on the host
    undecodable: int = 0  # agent events the client could not decode (each kind's first is also a notice)


class RunHeader(Widget):
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "run-header--title",
        "run-header--ok",
        "run-header--warn",
        "run-header--bad",
        "run-header--muted",
        "run-header--simulated",
    }
    DEFAULT_CSS = """
    RunHeader { height: 1; background: $panel; padding: 0 1; }
    RunHeader > .run-header--title { color: $primary; text-style: bold; }
    RunHeader > .run-header--ok { color: $success; }
    RunHeader > .run-header--warn { color: $warning; text-style: bold; }
    RunHeader > .run-header--bad { color: $error; text-style: bold; }
    RunHeader > .run-header--muted { color: $text-muted; }
    RunHeader > .run-header--simulated { color: $warning; text-style: bold reverse; }
    """

    def __init__(self, model: HeaderModel, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model = model

    def _style(self, name: str) -> Style:
        return self.get_component_rich_style(f"run-header--{name}")

    def render(self) -> RenderableType:
        m = self.model
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append("specdec ", style=self._style("title"))
        if m.readonly:  # first, so a narrow terminal never cuts it off
            out.append(" READ-ONLY ", style=self._style("simulated"))
            out.append(" ")
        out.append(m.target)
        if m.hostname and m.hostname not in m.target:
            out.append(f" ({m.hostname})", style=self._style("muted"))
        mark, cls = STATE_MARKS.get(m.state, ("?", "warn"))
        out.append("  ")
        out.append(f"{mark} {m.state}", style=self._style(cls))
        if m.state == "connected" and m.rtt_ms is not None:
            out.append(f" {m.rtt_ms:.0f} ms", style=self._style("muted"))
        if m.state != "connected":
            extra = []
            if m.attempt:
                extra.append(f"attempt {m.attempt}")
            if m.detail:
                extra.append(m.detail)
            if extra:
                out.append(f" ({'; '.join(extra)})", style=self._style(cls))
        out.append("  run ", style=self._style("muted"))
        if m.run_id:
            out.append(m.run_id)
            state = m.run_state or "?"
            out.append(f" {state}", style=self._style(RUN_STATE_CLASS.get(state, "warn")))
            if m.failed_rank:
                out.append(f" at {m.failed_rank}", style=self._style("bad"))
            if m.restarts:
                out.append(f"  {m.restarts}", style=self._style("warn" if m.restarted else "muted"))
        else:
            out.append("none", style=self._style("muted"))
        if m.undecodable:
            out.append(f"  {m.undecodable} agent events not understood", style=self._style("bad"))
        if m.simulated:
            out.append("  ")
            out.append(" SIMULATED GPUs ", style=self._style("simulated"))

        return printable_rendered(out, one_line=True)  # the hostname, run id and details are the host's words
