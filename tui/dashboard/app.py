"""The dashboard app: ``specdec-tui connect TARGET``.

Events from the session arrive on the asyncio loop, one listener call each; they go straight into
bounded models (``DashboardState``) and the screen draws what changed every ``flush_interval_s``
inside ``batch_update()``. Connection changes are drawn at once. Commands run in workers so the
screen never waits on the network.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from textual import actions
from textual.app import SystemCommand
from textual.css.query import NoMatches
from textual.dom import DOMNode
from textual.screen import Screen
from textual.theme import Theme
from textual.widgets import Input
from textual.worker import Worker, WorkerCancelled, WorkerFailed

from tui.dashboard import keys, live_reload, panes, theming
from tui.dashboard.controls import Handler, RunControl, ViewControl, action_table, run_external
from tui.dashboard.messages import ConnectionChanged
from tui.dashboard.plain import PlainNotices
from tui.dashboard.screens.dashboard import DashboardScreen
from tui.dashboard.state import DashboardState, Dirty
from tui.link.events import ClientEvent, ConnectionEvent
from tui.link.session import AgentSession
from tui.profiles import Profile, ProfileError, default_config_path, resolve_profile

__all__ = ["DashboardApp", "run_dashboard"]

FLUSH_INTERVAL_S = 0.1
CHART_INTERVAL_S = 0.25  # charts redraw at most 4 times a second

ON_CONNECT = ("none", "offer", "launch")
GC_GEN0_THRESHOLD = 20_000  # allocations between young collections (CPython's default is 700)


class DashboardApp(PlainNotices):
    """Live view of one target; keys drive the run (launch, restart, stop, kill stale, attach).

    The app draws and routes: each key's action goes to the object that owns it (tui/dashboard/controls.py).
    """

    CSS_PATH = "app.tcss"
    TITLE = "specdec-tui"
    BINDINGS = keys.bindings()  # type: ignore[assignment]

    def __init__(
        self,
        session: AgentSession,
        *,
        profile: Profile | None = None,
        theme: str | None = None,
        flush_interval_s: float | None = FLUSH_INTERVAL_S,
        chart_interval_s: float = CHART_INTERVAL_S,
        clock: Callable[[], float] = time.time,
        external_runner: Callable[[list[str]], int] = run_external,
        connect: bool = True,
        max_log_lines: int = 20_000,
        gpu_interval_s: float = 0.5,
        procs_interval_s: float = 1.0,
        on_connect: str = "none",
        tune_gc: bool = False,
        live_reload: bool = False,
        config: str | None = None,
    ) -> None:
        """``live_reload``: watch theme files and the profiles' config file (``config``, else the session's
        ``--config``, else the default path) and reload them when they change; off in tests and snapshots."""
        super().__init__()
        if on_connect not in ON_CONNECT:
            raise ValueError(f"on_connect: got {on_connect!r}; allowed: {', '.join(ON_CONNECT)}")
        self.on_connect = on_connect
        self.tune_gc = tune_gc
        self.session = session
        self.profile = profile
        self.flush_interval_s = flush_interval_s
        self.chart_interval_s = chart_interval_s
        self.clock = clock
        self.auto_connect = connect
        self.gpu_interval_s = gpu_interval_s
        self.procs_interval_s = procs_interval_s
        self.state = DashboardState(session.target_display, max_log_lines=max_log_lines, clock=clock)
        self.state.header.readonly = session.opts.readonly  # shown first in the header
        self.state.header.state = session.state
        self.exit_message: str | None = None
        self.flushes = 0
        self.sample_latency_ms: deque[float] = deque(maxlen=10_000)  # GPU sample time -> drawn
        self._last_chart_draw = 0.0
        self._unsubscribe: Callable[[], None] | None = None
        self._persist_theme = False
        self._requested_theme = theme
        loaded = theming.load_themes()
        self.theme_errors = loaded.errors
        for item in loaded.themes.values():
            self.register_theme(item)
        keymap, self.keymap_errors = keys.valid_keymap(theming.saved_keymap())
        self.user_keymap = keymap
        self.run_control = RunControl(self, session, self.state, lambda: self.profile, external_runner)
        self.view_control = ViewControl(self, lambda: self.dashboard, keymap)
        self.view_control.theme_names = list(loaded.themes)
        self.actions: dict[str, Handler] = action_table(self.run_control, self.view_control, self.quit_dashboard)
        self.live_reload = live_reload
        self.profiles_config = config if config is not None else session.opts.config
        self.profile_name: str | None = session.opts.profile
        self.live_reload_worker: Worker[None] | None = None
        self.watching: list[str] = []  # the directories the file watcher watches, once it does
        self._watch_stop = asyncio.Event()

    # -- life cycle --------------------------------------------------------------------------------

    def get_default_screen(self) -> Screen[Any]:
        return DashboardScreen(self.state, self.user_keymap)

    @property
    def dashboard(self) -> DashboardScreen:
        screen = self.screen_stack[0]
        assert isinstance(screen, DashboardScreen)
        return screen

    def on_mount(self) -> None:
        wanted = self._requested_theme or theming.saved_theme() or theming.DEFAULT_THEME
        if wanted not in self.available_themes:
            self.notify(f"no theme named {wanted!r}; using {theming.DEFAULT_THEME}", severity="warning")
            wanted = theming.DEFAULT_THEME
        self.theme = wanted
        if self._requested_theme:
            theming.save_theme(wanted)
        self.theme_changed_signal.subscribe(self, self._on_theme_changed)
        if self.user_keymap:
            self.set_keymap(self.user_keymap)
        for complaint in [*self.theme_errors, *self.keymap_errors]:
            self.notify(complaint, severity="warning", timeout=10)
        self._unsubscribe = self.session.add_event_listener(self._on_agent_event)
        if self.session.agent:
            self.state.ingest(self.session.agent)
        if self.flush_interval_s is not None:
            self.set_interval(self.flush_interval_s, self.flush_events, name="flush")
        else:  # deterministic mode (snapshots): nothing may change between frames on its own
            for box in self.query(Input):
                box.cursor_blink = False
        if self.auto_connect:
            self.run_worker(self._connect_and_stream(), name="connect", exit_on_error=False)
        if self.tune_gc:
            self.call_after_refresh(self._tune_gc)
        if self.live_reload:
            self.live_reload_worker = self.run_worker(
                self._watch_files(), name="live-reload", group="watch", exit_on_error=False
            )

    def _tune_gc(self) -> None:
        """Measured under a 100k lines/s burst: full collections of the app's long-lived objects took 50-87 ms,
        the worst key-to-frame stalls. Freeze what exists after the first frame and collect young objects less
        often. Only for the real app (run_dashboard): frozen objects are never freed."""
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_GEN0_THRESHOLD, 50, 1000)

    def _on_theme_changed(self, theme: Theme) -> None:
        theming.save_theme(theme.name)

    async def _connect_and_stream(self) -> None:
        try:
            if self.session.state != "connected":
                await self.session.connect()
            if self.session.agent:
                self.state.ingest(self.session.agent)
            await self.session.start_streams(self.gpu_interval_s, self.procs_interval_s)
            if self.on_connect != "none":
                await self.run_control.offer_launch(self.on_connect)
        except Exception as exc:  # ConnectError / CommandFailed: shown in the header, the app stays up
            message = getattr(exc, "message", None) or str(exc)
            self.state.ingest(ConnectionEvent(self.session.state, message, None))
            self.post_message(ConnectionChanged(self.session.state, message))
            self.notify(f"cannot connect: {message}", severity="error", timeout=15)

    async def on_unmount(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        await self._stop_watching()

    async def _stop_watching(self) -> None:
        """End the file watcher (its thread notices within live_reload.CHANGE_STEP_MS) and wait for it."""
        self._watch_stop.set()
        worker = self.live_reload_worker
        if worker is None or worker.is_finished:
            return
        with contextlib.suppress(WorkerCancelled, WorkerFailed, asyncio.TimeoutError):
            await asyncio.wait_for(worker.wait(), live_reload.STOP_TIMEOUT_S)

    # -- live reload of themes and profiles ----------------------------------------------------------

    async def _watch_files(self) -> None:
        config_file = Path(self.profiles_config).expanduser() if self.profiles_config else default_config_path()
        watched = live_reload.watched(config_file)

        def ready() -> None:
            self.watching = [str(d) for d in watched.directories]

        await live_reload.watch(watched, self._watch_stop, ready, self._files_changed)

    def _files_changed(self, kinds: live_reload.ChangeKinds) -> None:
        if kinds.theme_files:
            self.reload_themes(kinds.theme_files)
        if kinds.config:
            self.reload_profiles()

    def reload_themes(self, changed: tuple[Path, ...] = ()) -> None:
        """Read every theme file again: changed themes are registered (the current one repaints), a broken
        file is reported and the theme it held before stays."""
        try:
            loaded = theming.load_themes()
        except (ValueError, OSError) as exc:  # a broken shipped theme (ThemeError, TOMLDecodeError are ValueErrors)
            errors = [str(exc)]
            loaded = theming.ThemeSet()
        else:
            errors = [e for e in loaded.errors if not changed or any(p.name in e for p in changed)]
        before = dict(self.available_themes)
        changed_names = [name for name, theme in loaded.themes.items() if before.get(name) != theme]
        for name in changed_names:
            self.register_theme(loaded.themes[name])
        view = self.view_control
        view.theme_names = list(dict.fromkeys([*view.theme_names, *loaded.themes]))
        if self.theme in changed_names:
            self.refresh_css(animate=False)
        for error in errors:
            self.notify(f"{error}; the theme loaded before stays", severity="error", timeout=15)
        if changed_names:
            self.notify(f"theme reloaded: {', '.join(changed_names)}", timeout=4)

    def reload_profiles(self) -> None:
        """Read the profiles' config file again; a broken one is reported and the profile loaded before stays."""

        try:
            profile = resolve_profile(self.profile_name, self.profiles_config)
        except ProfileError as exc:
            self.notify(f"{exc}; the profiles loaded before stay", severity="error", timeout=15)
            return
        self.profile = profile
        self.notify(f"profile {profile.name} reloaded from {profile.source}", timeout=4)

    # -- events in ---------------------------------------------------------------------------------

    def _on_agent_event(self, ev: ClientEvent) -> None:
        self.state.ingest(ev)
        if isinstance(ev, ConnectionEvent):
            self.post_message(ConnectionChanged.from_event(ev))

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        """Drawn at once, not on the next flush: a lost link must show immediately."""
        if self.screen_stack and self.dashboard.ready:
            self.dashboard.query_one(f"#{panes.HEADER.id}").refresh()
        if message.state == "connected" and self.session.agent:
            self.state.ingest(self.session.agent)

    def flush_events(self, *, force_charts: bool = False) -> None:
        """Draw what arrived since the last flush (one batch, one frame)."""
        if not self.screen_stack or not self.dashboard.ready:
            return
        state = self.state
        state.header.rtt_ms = self.session.rtt_ms
        if state.header.state != self.session.state and self.session.state:
            state.header.state = self.session.state
            state.dirty.add(Dirty.HEADER)
        if not state.dirty and not state.notices:
            return
        self.flushes += 1
        now = time.monotonic()
        charts_allowed = (
            force_charts or self.flush_interval_s is None or now - self._last_chart_draw >= self.chart_interval_s
        )
        if charts_allowed and (Dirty.CHARTS in state.dirty or state.charts.dirty):
            self._last_chart_draw = now
        sampled = state.gpus.t if state.gpus is not None and Dirty.GPUS in state.dirty else None
        try:
            with self.batch_update():
                self.dashboard.apply(charts_allowed=charts_allowed)
        except NoMatches:
            return  # the panes are being torn down (the app is exiting)
        while state.notices:
            severity, text = state.notices.popleft()
            self.notify(text, severity=severity, timeout=8)  # type: ignore[arg-type]
        if sampled is not None:
            self.call_after_refresh(self._record_sample_latency, sampled)

    def _record_sample_latency(self, sampled_t: float) -> None:
        self.sample_latency_ms.append((time.time() - sampled_t) * 1000.0)

    async def quit_dashboard(self) -> None:
        run = self.state.run
        if run and run.state in ("running", "starting"):
            message = (
                f"Left the dashboard. Run {run.run_id} keeps running on {self.session.target_display}; "
                "run specdec-tui connect with the same target to watch it again."
            )
        else:
            message = "Left the dashboard; nothing was stopped on the target."
        self.notify(message, timeout=5)
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        try:
            await asyncio.wait_for(self.session.close(), 5.0)
        except (asyncio.TimeoutError, OSError, ConnectionError) as exc:
            message += f" (closing the connection: {exc})"
        self.exit_message = message
        self.exit(0, return_code=0, message=message)

    # -- keys ----------------------------------------------------------------------------------------

    async def run_action(
        self,
        action: str | actions.ActionParseResult,
        default_namespace: DOMNode | None = None,
        namespaces: Mapping[str, DOMNode] | None = None,
    ) -> bool:
        """A key's action of the app's own table goes to its owner; any other action is Textual's."""
        handler = self._owned_action(action, default_namespace)
        if handler is None:
            return await super().run_action(action, default_namespace, namespaces)
        result = handler()
        if inspect.isawaitable(result):
            await result
        return True

    def _owned_action(self, action: str | actions.ActionParseResult, namespace: DOMNode | None) -> Handler | None:
        if namespace not in (None, self):
            return None  # a widget's or a screen's own binding
        destination, name, params = action if isinstance(action, tuple) else actions.parse(action)
        if destination not in ("", "app") or params:
            return None
        return self.actions.get(name)

    # -- command palette ---------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for spec in keys.KEY_TABLE:
            yield SystemCommand(spec.description, spec.tooltip, partial(self.run_action, spec.action))


def run_dashboard(
    session: AgentSession,
    *,
    profile: Profile | None = None,
    theme: str | None = None,
    on_connect: str = "offer",
) -> int:
    """Run the dashboard on this terminal until the user quits; returns the process exit status.

    on_connect: "offer" asks to launch the profile's run when none is active, "launch" starts it, "none" waits.
    """
    app = DashboardApp(session, profile=profile, theme=theme, on_connect=on_connect, tune_gc=True, live_reload=True)
    app.run()
    return app.return_code if app.return_code is not None else 0
