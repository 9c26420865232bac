"""Per-GPU bars (utilization, memory used/total, temperature, power) with anomaly badges.

A badge is focusable: focusing it writes the anomaly's sentence under the bars (and it has a
tooltip), so "100% busy, 0 MiB, no process" explains itself. A simulated source says so.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from engine.protocol import Anomaly, GpuInfo, GpusEvent
from tui.dashboard.widgets.text_line import TextLine
from tui.hosttext import printable

BADGE_LABELS = {
    "phantom_utilization": "PHANTOM UTIL",
    "orphan_memory": "ORPHAN MEM",
    "stale_holder": "STALE HOLDER",
    "stalled_run": "STALLED",
    "dead_thread": "DEAD THREAD",
    "foreign_holder": "OTHER CT/HOST",
}
GPU_ANOMALIES = ("phantom_utilization", "orphan_memory", "stale_holder", "foreign_holder")


def bar(fraction: float | None, width: int) -> str:
    if fraction is None:
        return "?" * width
    fraction = max(0.0, min(1.0, fraction))
    full = round(fraction * width)
    return "█" * full + "░" * (width - full)


def short_gpu_name(name: str) -> str:
    """A GPU's name as its row shows it: the vendor dropped, 10 columns (``NVIDIA H200`` -> ``H200``)."""
    return name.replace("NVIDIA ", "")[:10]


class AnomalyBadge(Static, can_focus=True):
    DEFAULT_CSS = """
    AnomalyBadge { width: auto; height: 1; margin: 0 0 0 1; padding: 0 1; background: $error 30%; color: $error;
                   text-style: bold; }
    AnomalyBadge.-warning { background: $warning 30%; color: $warning; }
    AnomalyBadge:focus { background: $error; color: $background; }
    AnomalyBadge.-warning:focus { background: $warning; color: $background; }
    """

    def __init__(self, anomaly: Anomaly) -> None:
        kind = anomaly.kind
        super().__init__(printable(BADGE_LABELS.get(kind, kind.upper())), markup=False)
        self.anomaly = anomaly
        self.tooltip = anomaly.message
        if kind in ("stale_holder", "orphan_memory", "foreign_holder"):
            self.add_class("-warning")

    def on_focus(self) -> None:
        for pane in self.ancestors:
            if isinstance(pane, GpuBars):
                pane.explain(self.anomaly)
                break


class GpuRow(Horizontal):
    DEFAULT_CSS = """
    GpuRow { height: 1; }
    GpuRow > .gpu-line { width: 1fr; }
    """

    def __init__(self, index: int, line: Text, anomalies: list[Anomaly]) -> None:
        super().__init__(id=f"gpu-row-{index}")
        self.index = index
        self._line = line
        self._initial = anomalies
        self._badges_key: tuple[str, ...] = tuple(f"{a.kind}|{a.message}" for a in anomalies)
        # Shown once its line is mounted: a row mounted in one frame is composed in a later one, and the frame
        # between painted it as a blank line (seen on an H200: the dashboard's first screen, GPUs pane one blank row).
        self.ready = False
        self._wanted = True
        self.display = False

    def compose(self) -> ComposeResult:
        yield TextLine(self._line, classes="gpu-line")
        for anomaly in self._initial:
            yield AnomalyBadge(anomaly)

    def on_mount(self) -> None:  # after compose: the line and the badges are mounted
        self.ready = True
        self.display = self._wanted
        for pane in self.ancestors:
            if isinstance(pane, GpuBars):
                pane.update_placeholder()
                break

    def want(self, shown: bool) -> None:
        """Show the row (once its line is mounted) or hide it (its GPU is missing from the sample)."""
        self._wanted = shown
        self.display = shown and self.ready

    def pending(self, line: Text, anomalies: list[Anomaly]) -> None:
        self._line = line
        self._initial = anomalies
        self._badges_key = tuple(f"{a.kind}|{a.message}" for a in anomalies)

    def set_badges(self, anomalies: list[Anomaly]) -> None:
        key = tuple(f"{a.kind}|{a.message}" for a in anomalies)
        if key == self._badges_key:
            return
        self._badges_key = key
        for old in list(self.query(AnomalyBadge)):
            old.remove()
        if anomalies:
            self.mount_all([AnomalyBadge(a) for a in anomalies])


class GpuBars(Vertical):
    """Keyed rows: one per GPU index, kept between samples and updated in place."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "gpu-bars--label",
        "gpu-bars--ok",
        "gpu-bars--high",
        "gpu-bars--hot",
        "gpu-bars--muted",
    }
    DEFAULT_CSS = """
    GpuBars { height: auto; border: round $panel-lighten-2; border-title-color: $text-muted; padding: 0 1; }
    GpuBars > .gpu-bars--label { color: $text-muted; }
    GpuBars > .gpu-bars--ok { color: $success; }
    GpuBars > .gpu-bars--high { color: $warning; }
    GpuBars > .gpu-bars--hot { color: $error; }
    GpuBars > .gpu-bars--muted { color: $text-muted; }
    GpuBars > #gpu-simulated { color: $warning; text-style: bold reverse; width: auto; display: none; }
    GpuBars > #gpu-simulated.-on { display: block; }
    GpuBars > #gpu-explain { color: $text; height: auto; display: none; }
    GpuBars > #gpu-explain.-on { display: block; }
    GpuBars > #gpu-empty { color: $text-muted; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "GPUs"
        self.gpus: list[GpuInfo] = []
        self.simulated = False
        self.nvml_error: str | None = None
        self.anomalies: list[Anomaly] = []
        self._rows: dict[int, GpuRow] = {}  # by GPU index, mounted once
        self._sampled = False  # a GPU sample has arrived (the placeholder stops saying it waits for one)

    def compose(self) -> ComposeResult:
        yield Static(" SIMULATED GPUs (--simulate-gpus): not real hardware ", id="gpu-simulated", markup=False)
        yield Static("waiting for the first GPU sample…", id="gpu-empty", markup=False)
        yield Static("", id="gpu-explain", markup=False)

    def explain(self, anomaly: Anomaly) -> None:
        box = self.query_one("#gpu-explain", Static)
        label = BADGE_LABELS.get(anomaly.kind, anomaly.kind)
        box.update(Text(printable(f"{label}: {anomaly.message}")))
        box.add_class("-on")

    def update_sample(self, event: GpusEvent) -> None:
        self._sampled = True
        self.gpus = event.gpus
        self.simulated = event.simulated or any(g.simulated for g in self.gpus)
        self.nvml_error = event.nvml_error
        self._render_rows()

    def update_anomalies(self, items: list[Anomaly]) -> None:
        self.anomalies = items
        self._render_rows()

    def update_placeholder(self) -> None:
        """The line in place of the rows while none is shown: why there are none, or that they are coming."""
        empty = self.query_one("#gpu-empty", Static)
        if not self.gpus:
            empty.display = True
            if self.nvml_error:
                empty.update(f"no GPU data: {printable(self.nvml_error)}")
            else:
                empty.update("no GPUs in the latest sample" if self._sampled else "waiting for the first GPU sample…")
            return
        wanted = {g.index for g in self.gpus}
        mounting = not any(row.ready for index, row in self._rows.items() if index in wanted)
        if mounting:  # this sample's rows are still mounting: one more frame
            empty.update("reading the GPU sample…")
        empty.display = mounting

    def _render_rows(self) -> None:
        self.query_one("#gpu-simulated").set_class(self.simulated, "-on")
        # A row of a GPU missing from this sample is hidden, not removed: removal waits for the next frame, and a
        # sample with the GPU again in the same frame would update the leaving row (seen on an H200: the pane
        # one blank row after an empty sample and a full one arrived together) or mount a second row of its id.
        wanted = {g.index for g in self.gpus}
        for index, kept in self._rows.items():
            kept.want(index in wanted)
        explain = self.query_one("#gpu-explain")
        first_index = self.gpus[0].index if self.gpus else None
        for gpu in self.gpus:
            index = gpu.index
            badges = self._anomalies_for(index, index == first_index)
            row = self._rows.get(index)
            if row is None:
                fresh = GpuRow(index, self.format_gpu(gpu), badges)
                self.mount(fresh, before=explain)
                self._rows[index] = fresh
            elif row.children:
                row.query_one(".gpu-line", TextLine).set_text(self.format_gpu(gpu))
                row.set_badges(badges)
            else:  # mounted this frame, not composed yet: compose will use these
                row.pending(self.format_gpu(gpu), badges)
        self.update_placeholder()

    def _anomalies_for(self, index: int, include_unplaced: bool) -> list[Anomaly]:
        """GPU anomalies of this GPU; those naming no GPU go on the first row."""
        return [
            a
            for a in self.anomalies
            if a.kind in GPU_ANOMALIES and (a.gpu == index or (include_unplaced and a.gpu is None))
        ]

    def format_gpu(self, gpu: GpuInfo) -> Text:
        label = self.get_component_rich_style("gpu-bars--label")
        muted = self.get_component_rich_style("gpu-bars--muted")
        util, used, total = gpu.util_pct, gpu.mem_used_mib, gpu.mem_total_mib
        temp, power = gpu.temp_c, gpu.power_w

        def level(frac: float | None) -> str:
            if frac is None:
                return "gpu-bars--muted"
            return "gpu-bars--hot" if frac >= 0.95 else "gpu-bars--high" if frac >= 0.8 else "gpu-bars--ok"

        text = Text(no_wrap=True, overflow="ellipsis")
        text.append(f"{gpu.index} ", style=label)
        name = printable(short_gpu_name(gpu.name))
        text.append(f"{name:<10} ", style=muted)
        ufrac = util / 100.0 if util is not None else None
        text.append("util ", style=label)
        text.append(bar(ufrac, 8), style=self.get_component_rich_style(level(ufrac)))
        text.append(f" {util:>3.0f}% " if util is not None else "   ?% ")
        mfrac = used / total if used is not None and total else None
        text.append("mem ", style=label)
        text.append(bar(mfrac, 8), style=self.get_component_rich_style(level(mfrac)))
        if used is not None and total is not None:
            text.append(f" {used / 1024:5.1f}/{total / 1024:.0f}G ")
        else:
            text.append(" ?G ")
        text.append(f"{temp:.0f}°C " if temp is not None else "–°C ", style=muted if temp is None else "")
        text.append(f"{power:.0f}W" if power is not None else "–W", style=muted if power is None else "")
        return text
