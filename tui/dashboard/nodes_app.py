"""The dashboard of one run across several nodes: ``specdec-tui connect gpu-a gpu-b`` (or ``--profile`` with nodes).

One session per node, each connected, streamed and reconnected on its own (a node whose link drops shows it on
its line while the others keep streaming). Events go into ``NodesState`` as they arrive and the screen draws
what changed every ``flush_interval_s``. ``s`` stops every node after a confirmation; ``/`` filters the merged
log (a node's label shows only that node); ``l`` launches the profile over every node and ``r`` restarts it
(each after a confirmation, waiting for the first step on every node); ``q`` leaves every run going.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, ClassVar

from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.screen import Screen

from tui.dashboard import theming
from tui.dashboard.controls import RunControl, run_external
from tui.dashboard.plain import PlainNotices
from tui.dashboard.screens.confirm import Choice, ConfirmScreen
from tui.dashboard.screens.nodes import NodesScreen, NodesState
from tui.dashboard.state import Dirty
from tui.hosttext import printable_lines
from tui.link.events import ClientEvent, ConnectionEvent
from tui.link.session import ConnectError
from tui.nodes import Launched, Node, choose_run, close_all, launch_run, node_cwd, stop_nodes
from tui.profiles import DEFAULT_PROFILE, Profile

FLUSH_INTERVAL_S = 0.1
CHART_INTERVAL_S = 0.25  # charts redraw at most 4 times a second
STOP_GRACE_S = 30.0

__all__ = ["NodesApp", "run_nodes_dashboard"]


class NodesApp(PlainNotices):
    """Live view of every node of one run."""

    TITLE = "specdec-tui"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("l", "launch_all", "Launch on every node"),
        Binding("r", "restart_all", "Restart on every node"),
        Binding("s", "stop_all", "Stop every node"),
        Binding("a", "on_node('attach')", "Attach to a node's tmux"),
        Binding("k", "on_node('kill_stale')", "Kill stale GPU holders on a node"),
        Binding("d", "on_node('stacks')", "Stacks of a node's run"),
        Binding("slash", "filter", "Filter"),
        Binding("f", "follow", "Follow"),
        Binding("t", "next_theme", "Theme"),
        Binding("q", "quit_nodes", "Quit"),
    ]

    def __init__(
        self,
        nodes: list[Node],
        *,
        profile: Profile | None = None,
        theme: str | None = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        gpu_interval_s: float = 0.5,
        procs_interval_s: float = 1.0,
        max_log_lines: int = 20_000,
        external_runner: Callable[[list[str]], int] = run_external,
    ) -> None:
        """``external_runner`` is handed the terminal for an attach (tmux attach, ssh -t ...)."""
        super().__init__()
        self.nodes = nodes
        self.profile = profile or Profile(name=DEFAULT_PROFILE)
        for node in nodes:
            if node.session is None:
                node.open()
        self.state = NodesState([n.label for n in nodes], max_log_lines=max_log_lines)
        self.state.readonly = self.readonly
        # Each node's own verbs (attach, kill stale with its confirmation, stacks), as the one-node dashboard has.
        self.controls = {
            n.label: RunControl(self, n.session, self.state.nodes[n.label], lambda: self.profile, external_runner)
            for n in nodes
            if n.session is not None
        }
        self.flush_interval_s = flush_interval_s
        self.gpu_interval_s = gpu_interval_s
        self.procs_interval_s = procs_interval_s
        self._requested_theme = theme
        self._unsubscribe: list[Any] = []
        self.theme_names: list[str] = []
        self.last_launch: Launched | None = None  # what the last l or r came to
        self._last_chart_draw = 0.0

    def get_default_screen(self) -> Screen[Any]:
        return NodesScreen(self.state)

    @property
    def screen_of_nodes(self) -> NodesScreen:
        screen = self.screen_stack[0]
        assert isinstance(screen, NodesScreen)
        return screen

    def on_mount(self) -> None:
        loaded = theming.load_themes()
        for item in loaded.themes.values():
            self.register_theme(item)
        self.theme_names = list(loaded.themes)
        wanted = self._requested_theme or theming.saved_theme() or theming.DEFAULT_THEME
        self.theme = wanted if wanted in self.available_themes else theming.DEFAULT_THEME
        for node in self.nodes:
            assert node.session is not None
            self._unsubscribe.append(node.session.add_event_listener(partial(self._on_event, node.label)))
            self.run_worker(self._connect(node), name=f"connect-{node.rank}", group="connect", exit_on_error=False)
        self.set_interval(self.flush_interval_s, self.flush, name="flush")

    async def _connect(self, node: Node) -> None:
        session = node.session
        assert session is not None
        try:
            await session.connect(retry=True)
            if session.agent:
                self.state.ingest(node.label, session.agent)
            await session.start_streams(self.gpu_interval_s, self.procs_interval_s)
        except ConnectError as exc:  # shown on the node's line; the other nodes keep streaming
            self.state.ingest(node.label, ConnectionEvent("failed", exc.message, None))

    def _on_event(self, label: str, ev: ClientEvent) -> None:
        self.state.ingest(label, ev)

    def flush(self) -> None:
        if not self.screen_stack or not self.screen_of_nodes.ready:
            return
        for node in self.nodes:
            assert node.session is not None
            header = self.state.nodes[node.label].header
            if header.rtt_ms != node.session.rtt_ms:
                header.rtt_ms = node.session.rtt_ms
                self.state.dirty.add(Dirty.HEADER)
            if node.session.state and header.state != node.session.state:
                header.state = node.session.state
                self.state.dirty.add(Dirty.HEADER)
        if not self.state.changed():
            return
        now = time.monotonic()
        charts_allowed = now - self._last_chart_draw >= CHART_INTERVAL_S
        if charts_allowed:
            self._last_chart_draw = now
        try:
            with self.batch_update():
                self.screen_of_nodes.apply(charts_allowed=charts_allowed)
        except NoMatches:
            return  # being torn down

    # -- keys ----------------------------------------------------------------------------------------

    def action_filter(self) -> None:
        self.screen_of_nodes.log_pane.open_filter()

    def action_follow(self) -> None:
        self.screen_of_nodes.log_pane.tail.action_follow()

    def action_next_theme(self) -> None:
        if self.theme_names:
            at = self.theme_names.index(self.theme) if self.theme in self.theme_names else -1
            self.theme = self.theme_names[(at + 1) % len(self.theme_names)]

    NODE_VERBS: ClassVar[dict[str, str]] = {
        "attach": "Attach to which node's run?",
        "kill_stale": "Kill stale GPU holders on which node?",
        "stacks": "Every thread's stack on which node?",
    }

    @property
    def readonly(self) -> bool:
        """Watching only (``connect --readonly``, the profile's ``readonly = true``): no key acts on any node."""
        return self.profile.readonly or any(n.opts.readonly for n in self.nodes)

    def _refused(self, what: str) -> bool:
        if self.readonly:
            self.notify(f"read-only: {what} is off in this dashboard (it only watches)", severity="warning")
        return self.readonly

    def action_on_node(self, verb: str) -> None:
        """Ask which node, then run that node's own ``verb`` (its RunControl asks again where it signals)."""
        acting = {"kill_stale": "kill stale", "stacks": "stack dumps"}  # both signal a node's processes
        if verb not in self.NODE_VERBS or (verb in acting and self._refused(acting[verb])):
            return
        choices = [Choice(str(n.rank), f"{n.rank}: {n.label}", "primary", str(n.rank)) for n in self.nodes[:10]]

        def picked(choice: str | None) -> None:
            node = next((n for n in self.nodes if str(n.rank) == choice), None)
            if node is None:
                return
            getattr(self.controls[node.label], verb)()

        body = "\n".join(f"  {n.rank}: {n.label}" for n in self.nodes)
        self.push_screen(
            ConfirmScreen(self.NODE_VERBS[verb], printable_lines(body), [*choices, Choice("no", "Cancel")]), picked
        )

    def action_stop_all(self) -> None:
        if self._refused("stop"):
            return
        shown = self._shown_run()
        run = f"run {shown}" if shown else "the multi-node run the nodes' records name (checked on every node)"
        body = f"SIGTERM to the processes of {run} on every node, then SIGKILL after the grace:\n" + self._node_list()
        self._ask("Stop the run on every node?", body, "Stop all", self._stop_all)

    def _ask(self, title: str, body: str, yes: str, then: Callable[[], Coroutine[Any, Any, None]]) -> None:
        def done(choice: str | None) -> None:
            if choice == "yes":
                self.run_worker(then(), group="command", exit_on_error=False)
            else:
                self.notify(f"{title.rstrip('?')}: cancelled", timeout=3)

        choices = [Choice("yes", yes, "error", "y"), Choice("no", "Cancel", "default", "n")]
        self.push_screen(ConfirmScreen(title, printable_lines(body), choices), done)

    def _node_list(self) -> str:
        return "\n".join(f"  node {n.rank}: {n.label}" for n in self.nodes)

    def _all_connected(self, what: str) -> bool:
        down = [n.label for n in self.nodes if n.session is None or n.session.state != "connected"]
        if down:
            self.notify(f"{what}: not connected to {', '.join(down)}; nothing was done", severity="error", timeout=12)
        return not down

    def action_launch_all(self) -> None:
        if self._refused("launch"):
            return
        running = self.state.combined()["running"]
        if running:
            self.notify(f"the run is running on {running} nodes: r restarts it, s stops it", timeout=6)
            return
        body = f"Start profile {self.profile.name} as one run over every node (the first hosts the rendezvous):\n"
        self._ask("Launch on every node?", body + self._node_list(), "Launch", self._launch_all)

    def action_restart_all(self) -> None:
        if self._refused("restart"):
            return
        body = f"Stop the run on every node, then start profile {self.profile.name} over every node again:\n"
        self._ask("Restart on every node?", body + self._node_list(), "Restart", self._restart_all)

    async def _launch_all(self) -> None:
        if not self._all_connected("launch"):
            return
        t0 = time.monotonic()
        self.notify(f"launching profile {self.profile.name} on {len(self.nodes)} nodes…", timeout=4)
        done = await launch_run(
            self.nodes,
            self.profile,
            command=None,
            cwd=lambda node: node_cwd(node, self.profile),
            wait="first-step",
            timeout_s=None,
        )
        self._said_launch(done, time.monotonic() - t0)

    def _said_launch(self, done: Launched, took_s: float) -> None:
        self.last_launch = done
        if done.ok:
            self.notify(f"run {done.run_id}: first step on all {len(self.nodes)} nodes in {took_s:.1f} s", timeout=8)
            return
        stopped = f"; stopped {', '.join(done.stopped)}" if done.stopped else ""
        self.notify(f"launch failed: {done.cause}{stopped}", severity="error", timeout=20)

    def _shown_run(self) -> str | None:
        """The run this dashboard means: the one every node shows (one id everywhere), else the one its last l or r
        started; None leaves it to the nodes' records (choose_run)."""
        shown = self.state.combined().get("run_id")
        if isinstance(shown, str):
            return shown
        return self.last_launch.run_id if self.last_launch is not None else None

    async def _restart_all(self) -> None:
        if not self._all_connected("restart"):
            return
        chosen = await choose_run(self.nodes, self._shown_run())
        if chosen.ambiguous:
            self.notify(f"not restarted: {chosen.why}", severity="error", timeout=15)
            return
        if chosen.run_id is not None:
            stopped = await stop_nodes(self.nodes, STOP_GRACE_S, chosen.run_id, missing_ok=True, current=chosen.current)
            for node, ok, text in stopped:
                if not ok:
                    self.notify(f"node {node.label} did not stop ({text}); not starting a new run", severity="error")
                    return
        await self._launch_all()

    async def _stop_all(self) -> None:
        reached = [n for n in self.nodes if n.session is not None and n.session.state == "connected"]
        for node in self.nodes:
            if node not in reached:
                self.notify(f"node {node.label}: not connected; not stopped", severity="error", timeout=12)
        chosen = await choose_run(reached, self._shown_run(), len(self.nodes))
        if chosen.run_id is None:
            self.notify(f"nothing stopped: {chosen.why}", severity="error", timeout=15)
            return
        self.notify(f"stopping run {chosen.run_id} on {len(reached)} nodes…", timeout=3)
        for node, ok, text in await stop_nodes(reached, STOP_GRACE_S, chosen.run_id, current=chosen.current):
            self.notify(
                f"node {node.label}: {'stopped' if ok else 'not stopped'}: {text}",
                severity="information" if ok else "error",
                timeout=8,
            )

    async def action_quit_nodes(self) -> None:
        """Leave every node's run as it is; only the connections close."""
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        with contextlib.suppress(asyncio.TimeoutError, OSError, ConnectionError):
            await asyncio.wait_for(close_all(self.nodes), 5.0)
        running = self.state.combined()["running"]
        message = (
            f"Left the dashboard; the run keeps running on {running} of {len(self.nodes)} nodes."
            if running
            else "Left the dashboard; nothing was stopped on any node."
        )
        self.exit(0, return_code=0, message=message)


def run_nodes_dashboard(nodes: list[Node], *, profile: Profile | None = None, theme: str | None = None) -> int:
    """Run the dashboard of ``nodes`` on this terminal until the user quits; returns the exit status."""
    app = NodesApp(nodes, profile=profile, theme=theme)
    app.run()
    return app.return_code if app.return_code is not None else 0
