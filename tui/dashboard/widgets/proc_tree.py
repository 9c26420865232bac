"""The run's process tree with its threads and their health; stale GPU holders listed apart.

Thread health comes from the engine's ``heartbeat``, ``step`` and ``thread_error`` events (and the
agent's ``dead_thread`` anomalies); thread names (``drafter-0``) join them to the process table. Under torchrun
every rank has the same thread names: health is kept per (rank, thread), a rank's ``distributed`` stage event
names its pid, and the tree groups each rank's threads under its process (``rank 1 (node 0)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rich.console import RenderableType
from rich.text import Text

from engine import protocol
from tui.dashboard.widgets.text_line import RowTracking
from tui.hosttext import printable, printable_rendered

STALE_HEARTBEAT_S = 30.0
SHORT_STATES = {"training": "train", "waiting": "wait", "starting": "start", "syncing": "sync", "warmup": "warm"}
MAX_THREADS = 256


ThreadKey = tuple[int | None, str]  # (torchrun rank or None outside torchrun, thread name)
MAX_THREAD_ROWS = 32


@dataclass(frozen=True)
class ThreadRow:
    """One row of the pane per thread name: the first thread so named and how many more share the name."""

    name: str
    tid: int | None
    native: int  # further threads with the same name: the ones a worker starts (CUDA, autograd, compile) inherit it


def thread_rows(threads: list[protocol.ThreadInfo]) -> list[ThreadRow]:
    """The threads grouped by name, in the order each name first appears."""
    first: dict[str, int | None] = {}
    counts: dict[str, int] = {}
    for thread in threads:
        if thread.name not in first:
            first[thread.name] = thread.tid
        counts[thread.name] = counts.get(thread.name, 0) + 1
    return [ThreadRow(name, tid, counts[name] - 1) for name, tid in first.items()]


@dataclass
class ThreadHealth:
    name: str
    rank: int | None = None
    state: str = "unknown"
    step: int | None = None
    tok_s: float | None = None
    heartbeat_t: float | None = None
    last_exception: str | None = None
    dead: bool = False


class ThreadHealthModel:
    def __init__(self) -> None:
        self.threads: dict[ThreadKey, ThreadHealth] = {}
        self.rank_pids: dict[int, tuple[int, int | None]] = {}  # pid -> (rank, node), from `distributed` stages
        self.main_rank: int | None = None  # the rank of the run's events.jsonl (the agent's anomalies read it)
        self.run_over = False  # the run ended: its threads' silence is no warning

    def _get(self, name: str, rank: int | None = None) -> ThreadHealth:
        health = self.threads.get((rank, name))
        if health is None:
            if len(self.threads) >= MAX_THREADS:
                oldest = min(self.threads.values(), key=lambda h: h.heartbeat_t or 0.0)
                del self.threads[(oldest.rank, oldest.name)]
            health = self.threads[(rank, name)] = ThreadHealth(name, rank)
        return health

    def ranks(self) -> list[int]:
        return sorted({r for r, _ in self.threads if r is not None} | {r for r, _ in self.rank_pids.values()})

    def add_engine_event(self, event: protocol.EngineEvent, main_file: bool = True) -> None:
        rank = event.rank
        if main_file and rank is not None:
            self.main_rank = rank
        if isinstance(event, protocol.StageEvent):
            if event.stage == "distributed" and rank is not None and event.pid is not None:
                self.rank_pids[event.pid] = (rank, event.node)
            return
        if isinstance(event, protocol.HeartbeatEvent) and event.thread:
            health = self._get(event.thread, rank)
            health.state = event.state
            if event.step is not None:
                health.step = event.step
            if event.tok_s is not None:
                health.tok_s = event.tok_s
            health.heartbeat_t = event.t
            if event.last_exception:
                health.last_exception = event.last_exception
            if health.state == "error":
                health.dead = True
        elif isinstance(event, protocol.StepEvent) and event.thread:
            health = self._get(event.thread, rank)
            health.step = event.step
            t = event.t
            if health.heartbeat_t is None or (t is not None and t > health.heartbeat_t):
                health.heartbeat_t = t
        elif isinstance(event, protocol.ThreadErrorEvent) and event.thread:
            health = self._get(event.thread, rank)
            health.last_exception = f"{event.exc_type}: {event.message}"
            if event.policy == "stop":
                health.dead = True
                health.state = "error"

    def mark_dead(self, thread: str, message: str) -> None:
        health = self._get(thread, self.main_rank)  # the agent's anomaly comes from the run's events.jsonl
        health.dead = True
        if not health.last_exception:
            health.last_exception = message

    def clear(self) -> None:
        self.threads.clear()
        self.rank_pids.clear()
        self.main_rank = None


def split_monitors(holders: list[protocol.HolderInfo]) -> tuple[list[protocol.HolderInfo], list[protocol.HolderInfo]]:
    """(stale candidates, monitors): a process NVML proves has no GPU context (nvidia-smi, nvitop, DCGM, an
    agent reading NVML) holds a device handle only; it frees nothing when stopped, so it is never stale."""
    return [h for h in holders if h.context is not False], [h for h in holders if h.context is False]


def short_cmd(cmd: str) -> str:
    """A command line as the pane shows it: the program's base name, and long absolute paths cut to their last
    two parts (``/opt/torch/.venv/bin/python3 /opt/.../torch/_inductor/compile_worker/__main__.py`` ->
    ``python3 …/compile_worker/__main__.py``), so the part that says what runs fits the row."""
    words = cmd.split(" ")
    if words and "/" in words[0]:
        words[0] = words[0].rsplit("/", 1)[-1] or words[0]
    for i, word in enumerate(words[1:], 1):
        parts = word.split("/")
        if word.startswith("/") and len(word) > 30 and len(parts) > 3:
            words[i] = "…/" + "/".join(parts[-2:])
    return " ".join(words)


def _program(cmd: str | None) -> str:
    """The program of a command line, as a short name (``python3 -m engine.agent.main`` -> ``python3``)."""
    first = (cmd or "?").split(" ", 1)[0]
    return first.rsplit("/", 1)[-1][:30]


class ProcTree(RowTracking):
    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "proc-tree--title",
        "proc-tree--proc",
        "proc-tree--muted",
        "proc-tree--ok",
        "proc-tree--warn",
        "proc-tree--dead",
        "proc-tree--stale",
    }
    DEFAULT_CSS = """
    ProcTree { height: auto; min-height: 3; border: round $panel-lighten-2; border-title-color: $text-muted;
               padding: 0 1; text-wrap: nowrap; text-overflow: ellipsis; }
    ProcTree > .proc-tree--title { color: $text-muted; text-style: bold; }
    ProcTree > .proc-tree--proc { color: $text; }
    ProcTree > .proc-tree--muted { color: $text-muted; }
    ProcTree > .proc-tree--ok { color: $success; }
    ProcTree > .proc-tree--warn { color: $warning; }
    ProcTree > .proc-tree--dead { color: $error; text-style: bold; }
    ProcTree > .proc-tree--stale { color: $warning; text-style: bold; }
    """

    def __init__(self, health: ThreadHealthModel, clock: Callable[[], float], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "processes"
        self.health = health
        self.clock = clock
        self.run_tree: list[protocol.ProcInfo] = []
        self.holders: list[protocol.HolderInfo] = []
        self.holders_source: protocol.HoldersSource | None = None
        self.host_map: protocol.HostMapState | None = None

    def update_procs(self, event: protocol.ProcsEvent | None) -> None:
        self.run_tree = event.run_tree if event else []
        self.holders = event.holders if event else []
        self.holders_source = event.holders_source if event else None
        self.host_map = event.host_map if event else None
        self.refresh()

    def _gpus_label(self, holder: protocol.HolderInfo) -> tuple[str, str]:
        """(text, style) of a holder's GPUs: exact from NVML, or the fd scan's guess said as such."""
        gpus = ",".join(str(g) for g in holder.gpus)
        if holder.gpus_source == "fd-scan":
            return f"gpu ? (fd scan: {gpus})  ", "warn"
        return f"gpu {gpus or '?'}  ", "muted"

    def _attribution_line(self, out: Text) -> None:
        source = self.holders_source
        if source is not None and source.source == "fd-scan":
            out.append("\n  GPUs from the fd scan, not exact: ", style=self._style("warn"))
            out.append(printable(source.detail[:120]), style=self._style("muted"))
        elif source is not None and source.source == "host-nvml":
            out.append("\n  exact, from the Proxmox host: ", style=self._style("ok"))
            out.append(printable(source.detail[:120]), style=self._style("muted"))
        if self.host_map is not None and self.host_map.state != "ok":
            out.append(f"\n  host view {printable(self.host_map.state)}: ", style=self._style("warn"))
            out.append(printable((self.host_map.detail or "")[:120]), style=self._style("muted"))

    def _style(self, name: str) -> Any:
        return self.get_component_rich_style(f"proc-tree--{name}")

    def _thread_line(
        self, out: Text, prefix: str, name: str, tid: int | None, now: float, rank: int | None = None, native: int = 0
    ) -> None:
        """One thread's row. When the full row does not fit the pane (80 columns), short forms (``train #85`` for
        training at step 85, ``0.1s`` for the heartbeat's age) and then the least telling parts (tok/s, then the
        heartbeat) give way, so the state and the step stay readable."""
        health = self.health.threads.get((rank, name))
        out.append(f"\n{prefix}", style=self._style("muted"))
        if health is None:
            out.append(f"{printable(name):<11}", style=self._style("proc"))
            if native:
                out.append(f" +{native} native", style=self._style("muted"))
            if tid is not None:
                out.append(f" tid {tid}", style=self._style("muted"))
            return
        age = now - health.heartbeat_t if health.heartbeat_t is not None else None
        if health.dead:
            state = (" DEAD", "dead")
        elif self.health.run_over:
            state = (" ended", "muted")
            age = None  # the time since its last beat only grows now
        elif age is not None and age > STALE_HEARTBEAT_S:
            state = (" SILENT", "warn")
        else:
            state = (f" {printable(health.state)}", "ok")
        brief = (f" {SHORT_STATES.get(health.state, printable(health.state))}", state[1]) if state[1] == "ok" else state
        live_rate = health.tok_s is not None and not health.dead and not self.health.run_over

        def parts(short: bool) -> list[tuple[str, str]]:
            out_parts = [(f"{printable(name)}" if short else f"{printable(name):<11}", "proc")]
            if native:
                out_parts.append((f" +{native}" if short else f" +{native} native", "muted"))
            out_parts.append(brief if short else state)
            if health.step is not None:
                out_parts.append((f" #{health.step}" if short else f" step {health.step}", "proc"))
            if age is not None:
                hb = f" {max(0.0, age):.1f}s" if short else f" hb {max(0.0, age):.1f}s"
                out_parts.append((hb, "warn" if age > 10 else "muted"))
            if live_rate and health.tok_s is not None:
                out_parts.append(
                    (f" {health.tok_s / 1000:.1f}k/s" if short else f" {health.tok_s / 1000:.1f}k tok/s", "muted")
                )
            if health.dead and health.last_exception:
                out_parts.append((f" {printable(health.last_exception[:80])}", "dead"))
            return out_parts

        room = self.size.width - len(prefix)
        chosen = parts(short=False)
        if room > 0 and sum(len(t) for t, _ in chosen) > room and not health.dead:
            chosen = parts(short=True)
            keep = 3 if native else 2  # the name and the state always; the step while it fits
            while len(chosen) > keep and sum(len(t) for t, _ in chosen) > room:
                chosen.pop()
        for text, style in chosen:
            out.append(text, style=self._style(style))

    def render(self) -> RenderableType:
        now = self.clock()
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append("run", style=self._style("title"))
        if not self.run_tree:
            out.append("\n  no run processes", style=self._style("muted"))
        drawn = self._draw_run_tree(out, now)
        self._draw_threads_without_process(out, drawn, now)
        here = [h for h in self.holders if h.scope == "here"]
        self._draw_stale_holders(out, [h for h in here if not h.in_run])
        self._draw_foreign_holders(out, [h for h in self.holders if h.scope != "here"])
        return self.track_rows(printable_rendered(out))

    def _draw_run_tree(self, out: Text, now: float) -> set[ThreadKey]:
        """Every process of the run under its parent; returns the threads drawn under one."""
        children: dict[int, list[protocol.ProcInfo]] = {}
        pids = {p.pid for p in self.run_tree}
        roots: list[protocol.ProcInfo] = []
        for proc in self.run_tree:
            if proc.ppid in pids:
                children.setdefault(proc.ppid, []).append(proc)
            else:
                roots.append(proc)
        # Before the first heartbeat the engine's threads are known only by their OS names: list every process's
        # named threads then; once heartbeats name the engine's threads, only those (a compile worker's CUDA
        # thread is not the user's business).
        draw = _TreeDraw(out, now, children, any(self._has_engine_threads(p) for p in self.run_tree))
        for root in roots:
            self._draw_process(draw, root, 0, [])
        return draw.drawn

    def _has_engine_threads(self, proc: protocol.ProcInfo) -> bool:
        rank = self.health.rank_pids.get(proc.pid, (None, None))[0]
        return any((rank, t.name) in self.health.threads for t in proc.threads)

    def _foldable(self, draw: _TreeDraw, proc: protocol.ProcInfo) -> bool:
        """A leaf of the tree with no rank and no engine thread: a pool worker, folded with its twins."""
        return (
            proc.pid not in draw.children
            and proc.pid not in self.health.rank_pids
            and not self._has_engine_threads(proc)
        )

    def _draw_process(
        self, draw: _TreeDraw, proc: protocol.ProcInfo, depth: int, like: list[protocol.ProcInfo]
    ) -> None:
        """A process's row (``like``: its twins folded into it), its rank, its threads, then its children."""
        indent = "  " * (depth + 1)
        self._process_line(draw.out, proc, indent, like)
        rank, node = self.health.rank_pids.get(proc.pid, (None, None))
        if rank is not None:
            draw.out.append(
                f"  rank {rank}" + (f" (node {node})" if node is not None else ""), style=self._style("title")
            )
        self._draw_process_threads(draw, proc, rank, indent)
        kids = draw.children.get(proc.pid, [])
        twins: dict[str, list[protocol.ProcInfo]] = {}
        for child in kids:
            if self._foldable(draw, child):
                twins.setdefault(child.cmd, []).append(child)
        folded: set[int] = set()
        for child in kids:
            if child.pid in folded:
                continue
            child_like = (
                [c for c in twins.get(child.cmd, []) if c.pid != child.pid] if self._foldable(draw, child) else []
            )
            folded.update(c.pid for c in child_like)
            self._draw_process(draw, child, depth + 1, child_like)

    def _process_line(self, out: Text, proc: protocol.ProcInfo, indent: str, like: list[protocol.ProcInfo]) -> None:
        """One process row; ``like`` are its siblings with the same command, folded into it with a count."""
        group = [proc, *like]
        out.append(f"\n{indent}{proc.pid} ", style=self._style("muted"))
        if like:  # the count before the command, which a narrow pane cuts
            out.append(f"×{len(group)} ", style=self._style("title"))
        out.append(printable(short_cmd(proc.cmd)[:60]), style=self._style("proc"))
        details = []
        cpu = [p.cpu_pct for p in group if p.cpu_pct is not None]
        rss = [p.rss_mib for p in group if p.rss_mib is not None]
        if cpu:
            details.append(f"cpu {sum(cpu):.0f}%")
        if rss:
            details.append(f"rss {sum(rss):.0f} MiB")
        if proc.state and not like:
            details.append(printable(proc.state))
        if details:
            out.append("  " + "  ".join(details), style=self._style("muted"))

    def _draw_process_threads(self, draw: _TreeDraw, proc: protocol.ProcInfo, rank: int | None, indent: str) -> None:
        argv0 = proc.cmd.split(" ", 1)[0].rsplit("/", 1)[-1]
        named = [t for t in proc.threads if (rank, t.name) in self.health.threads]
        if not named and not draw.any_engine_threads:
            named = [t for t in proc.threads if t.name not in ("", argv0)]
        rows = thread_rows(named)[:MAX_THREAD_ROWS]
        for i, row in enumerate(rows):
            draw.drawn.add((rank, row.name))
            branch = "└ " if i == len(rows) - 1 else "├ "
            self._thread_line(draw.out, indent + branch, row.name, row.tid, draw.now, rank, row.native)

    def _draw_threads_without_process(self, out: Text, drawn: set[ThreadKey], now: float) -> None:
        """The engine's threads heartbeats name that no process row showed, by rank."""
        orphans = sorted((key for key in self.health.threads if key not in drawn), key=lambda k: (k[0] or 0, k[1]))
        if not orphans:
            return
        out.append("\n  engine threads (from heartbeats)", style=self._style("muted"))
        last_rank: int | None = None
        for rank, name in orphans:
            if rank is not None and rank != last_rank:
                names = ", ".join(n for r, n in orphans if r == rank)
                out.append(f"\n    rank {rank}: ", style=self._style("title"))
                out.append(printable(names[:100]), style=self._style("muted"))
                last_rank = rank
            self._thread_line(out, "      " if rank is not None else "    ", name, None, now, rank)

    def _draw_stale_holders(self, out: Text, not_in_run: list[protocol.HolderInfo]) -> None:
        """This machine's GPU holders outside the run: the stale ones a row each, the monitors on one line."""
        stale, monitors = split_monitors(not_in_run)
        out.append("\n")
        out.append("stale GPU holders (not in this run)", style=self._style("title"))
        self._attribution_line(out)
        if not stale:
            out.append("\n  none", style=self._style("muted"))
        for holder in stale:
            out.append("\n  ! STALE ", style=self._style("stale"))
            out.append(f"{holder.pid} ", style=self._style("proc"))
            out.append(f"{printable(holder.user or '?')}  ", style=self._style("muted"))
            text, style = self._gpus_label(holder)
            out.append(text, style=self._style(style))
            used = holder.used_mib
            out.append(f"{used:.0f} MiB  " if used is not None else "? MiB  ", style=self._style("muted"))
            if not holder.resolved:
                out.append("(NVML pid not visible here) ", style=self._style("warn"))
            out.append(printable((holder.cmd or "")[:50]), style=self._style("proc"))
        if monitors:
            out.append("\n  monitors (a device handle, no GPU context): ", style=self._style("muted"))
            shown = ", ".join(f"{h.pid} {printable(_program(h.cmd))}" for h in monitors[:4])
            more = f" and {len(monitors) - 4} more" if len(monitors) > 4 else ""
            out.append(shown + more, style=self._style("muted"))

    def _draw_foreign_holders(self, out: Text, foreign: list[protocol.HolderInfo]) -> None:
        """GPU holders in other containers or on the host: shown, never stopped from here."""
        if foreign:
            out.append("\n")
            title = "other containers and the host (seen from the host, never stopped from here)"
            out.append(title, style=self._style("title"))
        for holder in foreign:
            where = f"ct {printable(holder.container)}" if holder.scope == "container" else "host"
            out.append(f"\n  {where:<8} ", style=self._style("warn"))
            out.append(f"host pid {holder.host_pid or holder.pid} ", style=self._style("proc"))
            out.append(f"{printable(holder.user or '?')}  ", style=self._style("muted"))
            out.append(self._gpus_label(holder)[0], style=self._style("muted"))
            used = holder.used_mib
            out.append(f"{used:.0f} MiB  " if used is not None else "? MiB  ", style=self._style("muted"))
            out.append(printable((holder.cmd or "")[:50]), style=self._style("proc"))


@dataclass
class _TreeDraw:
    """One drawing of the run's process tree: the text it writes to and what each process row needs."""

    out: Text
    now: float
    children: dict[int, list[protocol.ProcInfo]]  # parent pid -> its processes in the run
    any_engine_threads: bool  # heartbeats name some engine thread: only those are listed under a process
    drawn: set[ThreadKey] = field(default_factory=set)  # the threads drawn under a process
