"""Training charts: step, tok/s, loss, per-position accuracy and acceptance length τ, one series per thread.

Points come from the engine's ``step`` events (deduplicated by their byte offset in events.jsonl)
or, for foreign commands, from log lines carrying ``step=``, ``tok/s`` and ``loss=``. The engine's
``loss`` series is its ``loss_total`` (the weighted sum it trains on, the same number as its log line's
``loss=``), not the first position's loss. What ``loss`` and ``acc_i`` mean is ``LOSS_HELP`` / ``ACC_HELP``
(the widget's tooltip and the help screen show them). ``tau`` comes from the engine's ``eval`` events (every
``eval_every`` steps: greedy chain speculation with the target on held-out prompts), with the latest
per-position acceptance P(token j accepted | j-1 accepted) beside it.
Drawn with Unicode block sparklines; the app redraws at a bounded rate.
"""

from __future__ import annotations

import math
import re
from collections import deque
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rich.console import RenderableType
from rich.text import Text
from textual.widget import Widget

from engine import protocol
from tui.dashboard.widgets.text_line import RowTracking
from tui.hosttext import printable

SPARK_CHARS = "▁▂▃▄▅▆▇█"
MAX_POINTS = 600
METRICS: tuple[str, ...] = ("step", "tok/s", "loss", "acc", "tau")
DROP_FIRST: tuple[str, ...] = ("step", "tok/s", "loss", "tau", "acc")  # which rows give way first on a short pane
LOG_SERIES = "log"

# What the engine's numbers are (engine/trainer/draft/loss.py computes them; SpecForge's definitions).
LOSS_HELP = (
    "loss = sum_i 0.8^i * loss_i over the TTT steps i. loss_i = soft cross-entropy of the drafter against the "
    "target's distribution on the draft vocabulary, summed over the positions trained on (data loss mask and "
    "target's top token in the draft vocab) and divided by ALL B x T positions of the batch (SpecForge's "
    'normalisation; config loss_mean = "masked_positions" divides by the positions trained on instead).'
)
ACC_HELP = (
    "acc_i = positions where the drafter's top token at TTT step i equals the target's top token, divided by the "
    "positions in the data's loss mask (a target token outside the draft vocab counts as a miss); acc_0 is the "
    "first drafted token, acc_1 the second, ... Bars: acc_i of the latest step; sparkline: acc_0 over time."
)
TAU_HELP = (
    "tau = acceptance length: the engine's greedy chain speculation with the target on held-out prompts (every "
    "eval_every steps). The drafter proposes k tokens, the target keeps the longest prefix it agrees with plus its "
    "own next token; tau = mean tokens per target forward (1 to k + 1). Bars: P(draft token j accepted | j-1 "
    "accepted), j = 1..k, of the latest evaluation; @N: its step."
)
CHARTS_TOOLTIP = f"{LOSS_HELP}\n\n{ACC_HELP}\n\n{TAU_HELP}"

_STEP_RE = re.compile(r"\bstep[=:\s]\s*(\d+)")
_TOKS_AFTER_RE = re.compile(r"tok/s[=:]\s*([0-9]+(?:\.[0-9]+)?)")
_TOKS_BEFORE_RE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kKM]?)\s*tok/s")
_LOSS_RE = re.compile(r"\bloss[=:\s]\s*([-+]?(?:[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|nan|inf))", re.IGNORECASE)


def parse_log_metrics(line: str) -> dict[str, float]:
    """``step=``, ``tok/s`` and ``loss=`` values of one foreign log line (empty when none)."""
    out: dict[str, float] = {}
    if m := _STEP_RE.search(line):
        out["step"] = float(m.group(1))
    if m := _TOKS_AFTER_RE.search(line):
        out["tok/s"] = float(m.group(1))
    elif m := _TOKS_BEFORE_RE.search(line):
        out["tok/s"] = float(m.group(1)) * {"k": 1e3, "K": 1e3, "M": 1e6}.get(m.group(2), 1.0)
    if m := _LOSS_RE.search(line):
        out["loss"] = float(m.group(1))
    return out


def sparkline(values: list[float], width: int) -> str:
    """The last ``width`` values as block characters scaled between their min and max."""
    pts = [v for v in values[-width:] if math.isfinite(v)]
    if not pts:
        return ""
    lo, hi = min(pts), max(pts)
    span = hi - lo
    top = len(SPARK_CHARS) - 1
    if span <= 0:
        return SPARK_CHARS[top // 2] * len(pts)
    return "".join(SPARK_CHARS[round((v - lo) / span * top)] for v in pts)


def human(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "–" if value is None else str(value)
    mag = abs(value)
    if mag >= 1e6:
        return f"{value / 1e6:.2f}M"
    if mag >= 1e4:
        return f"{value / 1e3:.1f}k"
    if mag >= 100 or float(value).is_integer():
        return f"{value:.0f}"
    return f"{value:.3f}"


@dataclass
class Series:
    points: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=MAX_POINTS))

    def values(self) -> list[float]:
        return [v for _, v in self.points]

    def last(self) -> float | None:
        return self.points[-1][1] if self.points else None


class ChartModel:
    """Bounded series keyed by (metric, thread); engine events deduplicated by offset."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, str], Series] = {}
        self.acc_latest: dict[str, list[float]] = {}  # thread -> acc per TTT position, latest step
        self.accept_latest: dict[str, list[float]] = {}  # thread -> acceptance per draft position, latest eval
        self.eval_steps: dict[str, int] = {}  # thread -> step of the latest eval
        self.served: protocol.ServedEvent | None = None  # the latest serve-check of the run's export (vLLM)
        self.engine_offset = -1
        self.duplicate_events = 0
        self.points_added = 0
        self.dirty = False

    def _add(self, metric: str, thread: str, t: float, value: float) -> None:
        key = (metric, thread)
        series = self.series.get(key)
        if series is None:
            series = self.series[key] = Series()
        series.points.append((t, value))
        self.points_added += 1
        self.dirty = True

    def add_engine_event(self, offset: int | None, event: protocol.EngineEvent) -> bool:
        """Take one ``engine`` event; False when it was already taken (a resumed stream)."""
        if offset is not None:
            if offset <= self.engine_offset:
                self.duplicate_events += 1
                return False
            self.engine_offset = offset
        if isinstance(event, protocol.EvalEvent):
            self._add_eval(event)
        elif isinstance(event, protocol.ServedEvent):
            self.served = event
            self.dirty = True
        elif isinstance(event, protocol.StepEvent):
            self._add_step(event)
        return True

    def _add_step(self, event: protocol.StepEvent) -> None:
        thread = event.thread or "engine"
        t = event.t or 0.0
        self._add("step", thread, t, float(event.step))
        # Tokens inside conversations when the batch had padding: what was trained, not what was computed.
        rate = event.useful_tok_s if event.useful_tok_s is not None else event.tok_s
        if rate is not None:
            self._add("tok/s", thread, t, rate)
        if event.loss_total is not None:
            self._add("loss", thread, t, event.loss_total)  # the number the engine's log line calls loss=
        elif event.loss:
            finite = [x for x in event.loss if x is not None]
            if finite:
                self._add("loss", thread, t, finite[0])
        if event.acc:
            values = [x if x is not None else float("nan") for x in event.acc]
            self.acc_latest[thread] = values
            self._add("acc", thread, t, values[0])

    def _add_eval(self, event: protocol.EvalEvent) -> None:
        if event.tau is None:
            return  # a failed evaluation: its error is a notice
        thread = event.thread or "engine"
        self._add("tau", thread, event.t or 0.0, event.tau)
        if event.per_position_conditional:
            self.accept_latest[thread] = [x if x is not None else float("nan") for x in event.per_position_conditional]
        self.eval_steps[thread] = event.step

    def add_log_line(self, line: str, t: float) -> bool:
        found = parse_log_metrics(line)
        for metric, value in found.items():
            self._add(metric, LOG_SERIES, t, value)
        return bool(found)

    def threads(self) -> list[str]:
        """Engine threads; the series parsed from log lines only when there is no engine series."""
        names = {thread for _, thread in self.series}
        engine = sorted(names - {LOG_SERIES})
        return engine or sorted(names)

    def clear(self) -> None:
        self.series.clear()
        self.acc_latest.clear()
        self.accept_latest.clear()
        self.eval_steps.clear()
        self.served = None
        self.engine_offset = -1
        self.dirty = True


ChartRow = tuple[str, int, str, "Series"]  # metric, the thread's index (its colour), thread, its series


class Charts(RowTracking):
    """One row per (metric, thread): name, sparkline, latest value; acc_i as bars per position."""

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "charts--label",
        "charts--value",
        "charts--empty",
        "charts--series-0",
        "charts--series-1",
        "charts--series-2",
        "charts--series-3",
    }
    DEFAULT_CSS = """
    Charts { height: auto; min-height: 3; padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    Charts > .charts--label { color: $text-muted; }
    Charts > .charts--value { color: $text; text-style: bold; }
    Charts > .charts--empty { color: $text-muted; text-style: italic; }
    Charts > .charts--series-0 { color: $primary; }
    Charts > .charts--series-1 { color: $secondary; }
    Charts > .charts--series-2 { color: $accent; }
    Charts > .charts--series-3 { color: $success; }
    """

    def __init__(self, model: ChartModel, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model = model
        self.redraws = 0
        self.tooltip = CHARTS_TOOLTIP

    def redraw(self) -> None:
        self.model.dirty = False
        self.redraws += 1
        self.refresh()

    def render(self) -> RenderableType:
        model = self.model
        threads = model.threads()
        if not threads:
            return Text(
                "no step metrics yet (engine step events, or log lines with step= / tok/s / loss=)",
                style=self.get_component_rich_style("charts--empty"),
            )
        label_style = self.get_component_rich_style("charts--label")
        value_style = self.get_component_rich_style("charts--value")
        name_w = max(len(t) for t in threads)
        width = max(8, self.size.width - name_w - 22)
        out = Text(no_wrap=True, overflow="ellipsis")
        first = True
        rows: list[ChartRow] = []
        for metric in METRICS:
            for i, thread in enumerate(threads):
                found = model.series.get((metric, thread))
                if found is not None:
                    rows.append((metric, i, thread, found))
        rows, hidden = self._fit(rows, 1 if model.served is not None else 0)
        for metric, i, thread, series in rows:
            colour = self.get_component_rich_style(f"charts--series-{i % 4}")
            if not first:
                out.append("\n")
            first = False
            out.append(f"{metric:<6} {printable(thread):<{name_w}} ", style=label_style)
            if metric == "acc" and thread in model.acc_latest:
                per_pos = model.acc_latest[thread]
                bars = "".join(SPARK_CHARS[max(0, min(7, round(v * 7)))] if math.isfinite(v) else "?" for v in per_pos)
                out.append(f"acc_i {bars} ", style=colour)
                out.append(" ".join(f"{v:.2f}" for v in per_pos[:4]), style=value_style)
                out.append("  acc_0 ", style=label_style)
                out.append(sparkline(series.values(), max(4, width - 40)), style=colour)
                continue
            if metric == "tau":
                self._render_tau(out, thread, series, width, colour, label_style, value_style)
                continue
            out.append(f"{sparkline(series.values(), width):<{width}} ", style=colour)
            last = series.last()
            shown = f"{last:.3f}" if metric in ("loss", "acc") and last is not None else human(last)
            out.append(shown, style=value_style)
        if model.served is not None:
            out.append("\n")
            self._render_served(out, model.served, name_w, label_style, value_style)
        if hidden:
            what = ", ".join(dict.fromkeys(m for m, *_ in hidden))
            out.append(f"\n+{len(hidden)} rows hidden: {what}", style=label_style)
        return self.track_rows(out)

    def _fit(self, rows: list[ChartRow], extra: int) -> tuple[list[ChartRow], list[ChartRow]]:
        """The rows that fit the rows this pane has on a short terminal (``row_budget``), and those left out to
        make room, said on a last row: the least telling metrics go first (step, which every thread row also
        shows, then tok/s), never silently."""
        budget = self.row_budget()
        if budget is None or len(rows) + extra <= budget:
            return rows, []
        kept = list(range(len(rows)))
        for metric in DROP_FIRST:
            while len(kept) + extra + 1 > budget and any(rows[j][0] == metric for j in kept):
                kept.remove(max(j for j in kept if rows[j][0] == metric))
        while len(kept) + extra + 1 > budget and kept:
            kept.pop()
        return [rows[j] for j in kept], [r for j, r in enumerate(rows) if j not in kept]

    def row_budget(self) -> int | None:
        """On a short terminal the training pane has a fixed height (app.tcss): the rows inside it; else None
        (the pane grows with its rows, then scrolls)."""
        box = self.parent
        if not isinstance(box, Widget) or not self.screen.has_class("-short"):
            return None
        rows = box.content_region.height
        return rows if rows > 0 else None

    def _render_served(
        self, out: Text, served: protocol.ServedEvent, name_w: int, label_style: Any, value_style: Any
    ) -> None:
        """The last serve-check: vLLM's τ for the run's export, ours on the same prompts, its acceptance per
        draft position; or why it could not run."""
        out.append(f"{'served':<6} {'vLLM':<{name_w}} ", style=label_style)
        if served.tau is None:
            out.append(printable((served.error or "no figures")[:120]), style=label_style)
            return
        out.append(f"τ {served.tau:.2f}", style=value_style)
        where = f" @{served.step}" if served.step is not None else ""
        out.append(where + (f" k {served.k}" if served.k is not None else ""), style=label_style)
        if served.tau_ours is not None:
            out.append(f"  ours {served.tau_ours:.2f}", style=label_style)
        rates = [x for x in served.per_position if x is not None]
        if rates:
            out.append("  acc_i " + " ".join(f"{x:.2f}" for x in rates), style=label_style)
        if served.outputs_equal is not None and served.prompts:
            out.append(f"  greedy-equal {served.outputs_equal}/{served.prompts}", style=label_style)

    def _render_tau(
        self, out: Text, thread: str, series: Series, width: int, colour: Any, label_style: Any, value_style: Any
    ) -> None:
        """τ's sparkline and latest value, then the latest per-position acceptance as bars (draft token 1..k)."""
        per_pos = self.model.accept_latest.get(thread, [])
        bars_w = len(per_pos) + 8 if per_pos else 0
        spark_w = max(4, width - bars_w - 10)
        out.append(f"{sparkline(series.values(), spark_w):<{spark_w}} ", style=colour)
        last = series.last()
        out.append(f"{last:.2f}" if last is not None else "–", style=value_style)
        step = self.model.eval_steps.get(thread)
        if step is not None:
            out.append(f" @{step}", style=label_style)
        if per_pos:
            bars = "".join(SPARK_CHARS[max(0, min(7, round(v * 7)))] if math.isfinite(v) else "?" for v in per_pos)
            out.append("  acc_j ", style=label_style)
            out.append(bars, style=colour)
