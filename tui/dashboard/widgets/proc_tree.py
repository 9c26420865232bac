"""The run's process tree with its threads and their health; stale GPU holders listed apart.

Thread health comes from the engine's ``heartbeat``, ``step`` and ``thread_error`` events (and the
agent's ``dead_thread`` anomalies); thread names (``drafter-0``) join them to the process table. Under torchrun
every rank has the same thread names: health is kept per (rank, thread), a rank's ``distributed`` stage event
names its pid, and the tree groups each rank's threads under its process (``rank 1 (node 0)``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.console import RenderableType
from rich.text import Text

from engine import protocol
from tui.dashboard.widgets.text_line import RowTracking

STALE_HEARTBEAT_S = 30.0
MAX_THREADS = 256


ThreadKey = tuple[int | None, str]  # (torchrun rank or None outside torchrun, thread name)


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
            out.append(source.detail[:120], style=self._style("muted"))
        elif source is not None and source.source == "host-nvml":
            out.append("\n  exact, from the Proxmox host: ", style=self._style("ok"))
            out.append(source.detail[:120], style=self._style("muted"))
        if self.host_map is not None and self.host_map.state != "ok":
            out.append(f"\n  host view {self.host_map.state}: ", style=self._style("warn"))
            out.append((self.host_map.detail or "")[:120], style=self._style("muted"))

    def _style(self, name: str) -> Any:
        return self.get_component_rich_style(f"proc-tree--{name}")

    def _thread_line(
        self, out: Text, prefix: str, name: str, tid: int | None, now: float, rank: int | None = None
    ) -> None:
        health = self.health.threads.get((rank, name))
        out.append(f"\n{prefix}", style=self._style("muted"))
        out.append(f"{name:<11}", style=self._style("proc"))
        if health is None:
            if tid is not None:
                out.append(f" tid {tid}", style=self._style("muted"))
            return
        age = now - health.heartbeat_t if health.heartbeat_t is not None else None
        if health.dead:
            out.append(" DEAD", style=self._style("dead"))
        elif age is not None and age > STALE_HEARTBEAT_S:
            out.append(" SILENT", style=self._style("warn"))
        else:
            out.append(f" {health.state}", style=self._style("ok"))
        if health.step is not None:
            out.append(f" step {health.step}", style=self._style("proc"))
        if age is not None:
            out.append(f" hb {max(0.0, age):.1f}s", style=self._style("warn" if age > 10 else "muted"))
        if health.tok_s is not None and not health.dead:
            out.append(f" {health.tok_s / 1000:.1f}k tok/s", style=self._style("muted"))
        if health.dead and health.last_exception:
            out.append(f" {health.last_exception[:80]}", style=self._style("dead"))

    def render(self) -> RenderableType:
        now = self.clock()
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append("run", style=self._style("title"))
        seen_threads: set[ThreadKey] = set()
        if not self.run_tree:
            out.append("\n  no run processes", style=self._style("muted"))
        children: dict[int, list[protocol.ProcInfo]] = {}
        pids = {p.pid for p in self.run_tree}
        roots: list[protocol.ProcInfo] = []
        for proc in self.run_tree:
            if proc.ppid in pids:
                children.setdefault(proc.ppid, []).append(proc)
            else:
                roots.append(proc)

        def walk(proc: protocol.ProcInfo, depth: int) -> None:
            indent = "  " * (depth + 1)
            out.append(f"\n{indent}{proc.pid} ", style=self._style("muted"))
            out.append(proc.cmd[:60], style=self._style("proc"))
            details = []
            if proc.cpu_pct is not None:
                details.append(f"cpu {proc.cpu_pct:.0f}%")
            if proc.rss_mib is not None:
                details.append(f"rss {proc.rss_mib:.0f} MiB")
            if proc.state:
                details.append(proc.state)
            if details:
                out.append("  " + "  ".join(details), style=self._style("muted"))
            rank, node = self.health.rank_pids.get(proc.pid, (None, None))
            if rank is not None:
                out.append(
                    f"  rank {rank}" + (f" (node {node})" if node is not None else ""), style=self._style("title")
                )
            argv0 = proc.cmd.split(" ", 1)[0].rsplit("/", 1)[-1]
            named = [t for t in proc.threads if (rank, t.name) in self.health.threads] or [
                t for t in proc.threads if t.name not in ("", argv0)
            ]
            for i, thread in enumerate(named[:32]):
                seen_threads.add((rank, thread.name))
                branch = "└ " if i == len(named[:32]) - 1 else "├ "
                self._thread_line(out, indent + branch, thread.name, thread.tid, now, rank)
            for child in children.get(proc.pid, []):
                walk(child, depth + 1)

        for root in roots:
            walk(root, 0)
        orphans = sorted(
            (key for key in self.health.threads if key not in seen_threads), key=lambda k: (k[0] or 0, k[1])
        )
        if orphans:
            out.append("\n  engine threads (from heartbeats)", style=self._style("muted"))
            last_rank: int | None = None
            for rank, name in orphans:
                if rank is not None and rank != last_rank:
                    names = ", ".join(n for r, n in orphans if r == rank)
                    out.append(f"\n    rank {rank}: ", style=self._style("title"))
                    out.append(names[:100], style=self._style("muted"))
                    last_rank = rank
                self._thread_line(out, "      " if rank is not None else "    ", name, None, now, rank)
        here = [h for h in self.holders if h.scope == "here"]
        foreign = [h for h in self.holders if h.scope != "here"]
        stale = [h for h in here if not h.in_run]
        out.append("\n")
        out.append("stale GPU holders (not in this run)", style=self._style("title"))
        self._attribution_line(out)
        if not stale:
            out.append("\n  none", style=self._style("muted"))
        for holder in stale:
            out.append("\n  ! STALE ", style=self._style("stale"))
            out.append(f"{holder.pid} ", style=self._style("proc"))
            out.append(f"{holder.user or '?'}  ", style=self._style("muted"))
            text, style = self._gpus_label(holder)
            out.append(text, style=self._style(style))
            used = holder.used_mib
            out.append(f"{used:.0f} MiB  " if used is not None else "? MiB  ", style=self._style("muted"))
            if not holder.resolved:
                out.append("(NVML pid not visible here) ", style=self._style("warn"))
            out.append((holder.cmd or "")[:50], style=self._style("proc"))
        if foreign:
            out.append("\n")
            title = "other containers and the host (seen from the host, never stopped from here)"
            out.append(title, style=self._style("title"))
        for holder in foreign:
            where = f"ct {holder.container}" if holder.scope == "container" else "host"
            out.append(f"\n  {where:<8} ", style=self._style("warn"))
            out.append(f"host pid {holder.host_pid or holder.pid} ", style=self._style("proc"))
            out.append(f"{holder.user or '?'}  ", style=self._style("muted"))
            out.append(self._gpus_label(holder)[0], style=self._style("muted"))
            used = holder.used_mib
            out.append(f"{used:.0f} MiB  " if used is not None else "? MiB  ", style=self._style("muted"))
            out.append((holder.cmd or "")[:50], style=self._style("proc"))
        return self.track_rows(out)
