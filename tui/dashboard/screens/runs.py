"""Past and current runs: a list (newest first), and the highlighted run's cause and log tail below it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import OptionList, Static
from textual.widgets.option_list import Option

from engine import protocol
from tui.hosttext import printable
from tui.timewords import duration, when

RUN_TAIL_LINES = 200
TailFetcher = Callable[[str], Awaitable[protocol.TailReply | None]]


def run_row(run: protocol.ListedRun) -> str:
    """One line of the list: id, state, start, duration, last step, exit."""
    step = run.last_step
    code, sig = run.exit_code, run.signal
    ended = f"signal {sig}" if sig is not None else f"exit {code}" if code is not None else ""
    mark = "*" if run.current else " "
    return printable(
        f"{mark} {run.run_id}  {run.state:<9} {when(run.started_at, year=False)}  "
        f"{duration(run.duration_s):>7}  step {step if step is not None else '-':<7} {ended}"
    )


def run_detail(run: protocol.ListedRun, tail: protocol.TailReply | None) -> str:
    """The cause first (why it ended), then what ran and the end of its output.log."""
    out = [printable(f"run {run.run_id}   state {run.state}")]
    if run.cause:
        out.append(f"cause: {printable(run.cause)}")
    if run.command:
        out.append("command: " + printable(" ".join(run.command)))
    if run.cwd:
        out.append(f"cwd: {printable(run.cwd)}")
    if run.output_dir:
        out.append(f"output: {printable(run.output_dir)}")
    if tail is None:
        out.append("(output.log could not be read)")
    else:
        lines = [protocol.decode_log_data(x).decode("utf-8", "replace") for x in tail.lines]
        out.append(f"--- last {len(lines)} lines of output.log ---")
        out += [printable(line) for line in lines]
    return "\n".join(out)


class RunsScreen(ModalScreen[None]):
    DEFAULT_CSS = """
    RunsScreen { align: center middle; }
    RunsScreen > Vertical { width: 95%; height: 90%; border: thick $primary; background: $surface; }
    RunsScreen #runs-title { text-style: bold; padding: 0 1; background: $panel; }
    RunsScreen #runs-list { height: 40%; }
    RunsScreen #run-detail-scroll { height: 1fr; padding: 0 1; }
    RunsScreen #run-detail { width: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q", "close", "Close")]

    def __init__(self, runs: list[protocol.ListedRun], total: int, fetch_tail: TailFetcher) -> None:
        super().__init__()
        self.runs = {r.run_id: r for r in runs}
        self.order = [r.run_id for r in runs]
        self.total = total
        self.fetch_tail = fetch_tail
        self.shown: str | None = None  # the run whose detail is on screen (set once its tail arrived)

    def compose(self) -> ComposeResult:
        title = f"runs: {len(self.order)} of {self.total}, newest first (* current) - Enter/↑↓ show one, Esc closes"
        with Vertical():
            yield Static(title, id="runs-title", markup=False)
            yield OptionList(*[Option(run_row(self.runs[i]), id=i) for i in self.order], id="runs-list", markup=False)
            with VerticalScroll(id="run-detail-scroll"):
                yield Static("no runs yet" if not self.order else "", id="run-detail", markup=False)

    def on_mount(self) -> None:
        listing = self.query_one("#runs-list", OptionList)
        listing.focus()
        if self.order:
            listing.highlighted = 0

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        if event.option.id is not None:
            self.show(event.option.id)

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        if event.option.id is not None:
            self.show(event.option.id)
            self.query_one("#run-detail-scroll").focus()

    def show(self, run_id: str) -> None:
        self.query_one("#run-detail", Static).update(f"run {run_id}: reading its log ...")
        self.run_worker(self._load(run_id), group="run-detail", exclusive=True, exit_on_error=False)

    async def _load(self, run_id: str) -> None:
        tail = await self.fetch_tail(run_id)
        self.query_one("#run-detail", Static).update(run_detail(self.runs[run_id], tail))
        self.shown = run_id

    def action_close(self) -> None:
        self.dismiss(None)
