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

from tui.widgets.text_line import RowTracking

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

    def add_engine_event(self, event: dict[str, Any], main_file: bool = True) -> None:
        kind = event.get("kind")
        thread = event.get("thread")
        rank = event.get("rank") if isinstance(event.get("rank"), int) else None
        if main_file and rank is not None:
            self.main_rank = rank
        if kind == "stage" and event.get("stage") == "distributed" and rank is not None:
            pid, node = event.get("pid"), event.get("node")
            if isinstance(pid, int):
                self.rank_pids[pid] = (rank, node if isinstance(node, int) else None)
        if not isinstance(thread, str) or not thread:
            return
        t = event.get("t")
        t = float(t) if isinstance(t, (int, float)) else None
        if kind == "heartbeat":
            health = self._get(thread, rank)
            health.state = str(event.get("state", health.state))
            if isinstance(event.get("step"), int):
                health.step = event["step"]
            if isinstance(event.get("tok_s"), (int, float)):
                health.tok_s = float(event["tok_s"])
            health.heartbeat_t = t
            exc = event.get("last_exception")
            if isinstance(exc, str) and exc:
                health.last_exception = exc
            if health.state == "error":
                health.dead = True
        elif kind == "step":
            health = self._get(thread, rank)
            if isinstance(event.get("step"), int):
                health.step = event["step"]
            if health.heartbeat_t is None or (t is not None and t > health.heartbeat_t):
                health.heartbeat_t = t
        elif kind == "thread_error":
            health = self._get(thread, rank)
            health.last_exception = f"{event.get('exc_type', 'Error')}: {event.get('message', '')}"
            if event.get("policy", "stop") == "stop":
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
        self.run_tree: list[dict[str, Any]] = []
        self.holders: list[dict[str, Any]] = []
        self.holders_source: dict[str, Any] = {}
        self.host_map: dict[str, Any] | None = None

    def update_procs(self, event: dict[str, Any]) -> None:
        self.run_tree = [p for p in event.get("run_tree") or [] if isinstance(p, dict)]
        self.holders = [h for h in event.get("holders") or [] if isinstance(h, dict)]
        src, host = event.get("holders_source"), event.get("host_map")
        self.holders_source = src if isinstance(src, dict) else {}
        self.host_map = host if isinstance(host, dict) else None
        self.refresh()

    def _gpus_label(self, holder: dict[str, Any]) -> tuple[str, str]:
        """(text, style) of a holder's GPUs: exact from NVML, or the fd scan's guess said as such."""
        gpus = ",".join(str(g) for g in holder.get("gpus") or [])
        if holder.get("gpus_source") == "fd-scan":
            return f"gpu ? (fd scan: {gpus})  ", "warn"
        return f"gpu {gpus or '?'}  ", "muted"

    def _attribution_line(self, out: Text) -> None:
        source = self.holders_source.get("source")
        if source == "fd-scan":
            out.append("\n  GPUs from the fd scan, not exact: ", style=self._style("warn"))
            out.append(str(self.holders_source.get("detail") or "")[:120], style=self._style("muted"))
        elif source == "host-nvml":
            out.append("\n  exact, from the Proxmox host: ", style=self._style("ok"))
            out.append(str(self.holders_source.get("detail") or "")[:120], style=self._style("muted"))
        if self.host_map is not None and self.host_map.get("state") != "ok":
            out.append(f"\n  host view {self.host_map.get('state')}: ", style=self._style("warn"))
            out.append(str(self.host_map.get("detail") or "")[:120], style=self._style("muted"))

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
        children: dict[int, list[dict[str, Any]]] = {}
        pids = {int(p.get("pid", -1)) for p in self.run_tree}
        roots: list[dict[str, Any]] = []
        for proc in self.run_tree:
            ppid = int(proc.get("ppid", -1))
            if ppid in pids:
                children.setdefault(ppid, []).append(proc)
            else:
                roots.append(proc)

        def walk(proc: dict[str, Any], depth: int) -> None:
            indent = "  " * (depth + 1)
            cpu = proc.get("cpu_pct")
            rss = proc.get("rss_mib")
            out.append(f"\n{indent}{proc.get('pid')} ", style=self._style("muted"))
            out.append(str(proc.get("cmd", ""))[:60], style=self._style("proc"))
            details = []
            if isinstance(cpu, (int, float)):
                details.append(f"cpu {cpu:.0f}%")
            if isinstance(rss, (int, float)):
                details.append(f"rss {rss:.0f} MiB")
            if proc.get("state"):
                details.append(str(proc["state"]))
            if details:
                out.append("  " + "  ".join(details), style=self._style("muted"))
            pid = int(proc.get("pid", -1))
            rank, node = self.health.rank_pids.get(pid, (None, None))
            if rank is not None:
                out.append(
                    f"  rank {rank}" + (f" (node {node})" if node is not None else ""), style=self._style("title")
                )
            threads = [t for t in proc.get("threads") or [] if isinstance(t, dict)]
            argv0 = str(proc.get("cmd", "")).split(" ", 1)[0].rsplit("/", 1)[-1]
            named = [t for t in threads if (rank, str(t.get("name", ""))) in self.health.threads] or [
                t for t in threads if str(t.get("name", "")) not in ("", argv0)
            ]
            for i, thread in enumerate(named[:32]):
                name = str(thread.get("name", ""))
                seen_threads.add((rank, name))
                branch = "└ " if i == len(named[:32]) - 1 else "├ "
                tid = thread.get("tid")
                self._thread_line(out, indent + branch, name, tid if isinstance(tid, int) else None, now, rank)
            for child in children.get(int(proc.get("pid", -1)), []):
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
        here = [h for h in self.holders if h.get("scope", "here") == "here"]
        foreign = [h for h in self.holders if h.get("scope", "here") != "here"]
        stale = [h for h in here if not h.get("in_run")]
        out.append("\n")
        out.append("stale GPU holders (not in this run)", style=self._style("title"))
        self._attribution_line(out)
        if not stale:
            out.append("\n  none", style=self._style("muted"))
        for holder in stale:
            out.append("\n  ! STALE ", style=self._style("stale"))
            out.append(f"{holder.get('pid')} ", style=self._style("proc"))
            out.append(f"{holder.get('user') or '?'}  ", style=self._style("muted"))
            text, style = self._gpus_label(holder)
            out.append(text, style=self._style(style))
            used = holder.get("used_mib")
            out.append(f"{used:.0f} MiB  " if isinstance(used, (int, float)) else "? MiB  ", style=self._style("muted"))
            if holder.get("resolved") is False:
                out.append("(NVML pid not visible here) ", style=self._style("warn"))
            out.append(str(holder.get("cmd") or "")[:50], style=self._style("proc"))
        if foreign:
            out.append("\n")
            title = "other containers and the host (seen from the host, never stopped from here)"
            out.append(title, style=self._style("title"))
        for holder in foreign:
            where = f"ct {holder.get('container')}" if holder.get("scope") == "container" else "host"
            out.append(f"\n  {where:<8} ", style=self._style("warn"))
            out.append(f"host pid {holder.get('host_pid') or holder.get('pid')} ", style=self._style("proc"))
            out.append(f"{holder.get('user') or '?'}  ", style=self._style("muted"))
            out.append(self._gpus_label(holder)[0], style=self._style("muted"))
            used = holder.get("used_mib")
            out.append(f"{used:.0f} MiB  " if isinstance(used, (int, float)) else "? MiB  ", style=self._style("muted"))
            out.append(str(holder.get("cmd") or "")[:50], style=self._style("proc"))
        return self.track_rows(out)
