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
import os
import shlex
import subprocess
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from textual.app import App, SuspendNotSupported, SystemCommand
from textual.css.query import NoMatches
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.theme import Theme
from textual.widgets import Input
from textual.worker import Worker, WorkerCancelled, WorkerFailed

from engine import protocol
from tui import attach, keys, live_reload, theming
from tui.messages import (
    CommandFinished,
    ConnectionChanged,
    LiveReloadReady,
    MilestoneReached,
    ProfilesReloaded,
    RunChanged,
    StreamBatch,
    ThemesReloaded,
)
from tui.relaunch import engine_python, restart_run
from tui.screens.confirm import Choice, ConfirmScreen
from tui.screens.dashboard import DashboardScreen, DashboardState
from tui.screens.help import HelpScreen
from tui.screens.kill_stale import KillStaleScreen
from tui.screens.runs import RUN_TAIL_LINES, RunsScreen
from tui.screens.stacks import StacksScreen

FLUSH_INTERVAL_S = 0.1
CHART_INTERVAL_S = 0.25  # charts redraw at most 4 times a second
STOP_TIMEOUT_S = 120.0
STACKS_TIMEOUT_S = 20.0
RUNS_SHOWN = 50  # newest runs listed by the runs screen (the agent caches scans of 64 runs)


class SessionLike(Protocol):
    """What the dashboard needs of ``tui.session.Session`` (tests may pass a recording stand-in)."""

    target_display: str
    state: str
    hello: dict[str, Any] | None
    rtt_ms: float | None

    async def connect(self) -> None: ...
    async def request(
        self, cmd: str, *, timeout_s: float | None = None, params: dict[str, Any] | None = None, **args: Any
    ) -> dict[str, Any]: ...
    def add_listener(self, fn: Callable[[dict[str, Any]], None]) -> Callable[[], None]: ...
    async def start_streams(self, gpu_interval_s: float = 0.5, procs_interval_s: float = 1.0) -> None: ...
    def attach_argv(self, tmux_session: str) -> list[str]: ...
    async def close(self) -> None: ...


def run_external(argv: list[str]) -> int:
    """Hand the terminal to ``argv`` (tmux attach, ssh -t ...) and return its exit status."""
    return subprocess.run(argv, check=False).returncode


def launch_spec_for(profile: dict[str, Any] | None, session: SessionLike) -> dict[str, Any]:
    """The ``launch`` command's arguments for a profile dict (a LaunchSpec dict, or a Profile.as_dict()).

    Raises ValueError with a sentence when no spec can be made.
    """
    from tui.profiles import EngineConfig, Profile, ProfileError, resolve_profile

    allowed = {f.name for f in fields(protocol.LaunchSpec)}
    if profile is None:
        config = getattr(getattr(session, "opts", None), "config", None)
        name = getattr(getattr(session, "opts", None), "profile", None)
        try:
            profile = resolve_profile(name, config).as_dict()
        except ProfileError as exc:
            raise ValueError(str(exc)) from exc
    if profile.get("command"):
        spec = {k: v for k, v in profile.items() if k in allowed and v is not None}
        if "profile" not in spec and isinstance(profile.get("name"), str):
            spec["profile"] = profile["name"]
        return spec
    engine = profile.get("engine") or {}
    prof = Profile(
        name=str(profile.get("name") or "default"),
        command=None,
        cwd=profile.get("cwd"),
        env=dict(profile.get("env") or {}),
        engine=EngineConfig(**{k: v for k, v in engine.items() if k in ("preset", "config", "args")}),
    )
    if isinstance(profile.get("step_pattern"), str):
        prof.step_pattern = profile["step_pattern"]
    if isinstance(profile.get("deadlines_s"), dict):
        prof.deadlines_s = dict(profile["deadlines_s"])
    if isinstance(profile.get("restart"), dict):
        prof.restart = dict(profile["restart"])
    python_path = (session.hello or {}).get("python_path")
    python = engine_python(
        getattr(getattr(session, "opts", None), "python", None), python_path if isinstance(python_path, str) else None
    )
    pythonpath = getattr(getattr(session, "transport", None), "engine_pythonpath", None)
    spec = protocol.to_jsonable(prof.launch_spec(None, python=python, engine_pythonpath=pythonpath))
    return {k: v for k, v in spec.items() if v is not None}


ON_CONNECT = ("none", "offer", "launch")
GC_GEN0_THRESHOLD = 20_000  # allocations between young collections (CPython's default is 700)


class DashboardApp(App[int]):
    """Live view of one target; keys drive the run (launch, restart, stop, kill stale, attach)."""

    CSS_PATH = "app.tcss"
    TITLE = "specdec-tui"
    BINDINGS = keys.bindings()  # type: ignore[assignment]

    def __init__(
        self,
        session: SessionLike,
        *,
        profile: dict[str, Any] | None = None,
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
        self._launch_asked = False  # the user pressed launch: no offer on connect
        self.session = session
        self.profile = profile
        self.flush_interval_s = flush_interval_s
        self.chart_interval_s = chart_interval_s
        self.clock = clock
        self.external_runner = external_runner
        self.auto_connect = connect
        self.gpu_interval_s = gpu_interval_s
        self.procs_interval_s = procs_interval_s
        self.state = DashboardState(session.target_display, max_log_lines=max_log_lines, clock=clock)
        self.state.header.state = session.state
        self.attach_history: list[list[str]] = []
        self.exit_message: str | None = None
        self.flushes = 0
        self.sample_latency_ms: deque[float] = deque(maxlen=10_000)  # GPU sample time -> drawn
        self._last_chart_draw = 0.0
        self._unsubscribe: Callable[[], None] | None = None
        self._persist_theme = False
        self._theme_names: list[str] = []
        self._requested_theme = theme
        loaded = theming.load_themes()
        self.theme_errors = loaded.errors
        for item in loaded.themes.values():
            self.register_theme(item)
        self._theme_names = list(loaded.themes)
        keymap, self.keymap_errors = keys.valid_keymap(theming.saved_keymap())
        self.user_keymap = keymap
        opts = getattr(session, "opts", None)
        self.live_reload = live_reload
        self.profiles_config = config if config is not None else getattr(opts, "config", None)
        self.profile_name: str | None = getattr(opts, "profile", None)
        self.live_reload_worker: Worker[None] | None = None
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
        self._unsubscribe = self.session.add_listener(self._on_agent_event)
        if self.session.hello:
            self.state.ingest(self.session.hello)
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
            if self.session.hello:
                self.state.ingest(self.session.hello)
            await self.session.start_streams(self.gpu_interval_s, self.procs_interval_s)
            if self.on_connect != "none":
                await self._launch_if_idle()
        except Exception as exc:  # ConnectError / CommandFailed: shown in the header, the app stays up
            message = getattr(exc, "message", None) or str(exc)
            self.state.ingest({"ev": "connection", "state": self.session.state, "detail": message, "attempt": None})
            self.post_message(ConnectionChanged(self.session.state, message))
            self.notify(f"cannot connect: {message}", severity="error", timeout=15)

    async def _launch_if_idle(self) -> None:
        """`connect --launch` starts the profile's run when none is active; plain `connect` offers it."""
        status = await self._request("status", timeout_s=30.0)
        run = (status or {}).get("run") or {}
        if run.get("state") in ("starting", "running") or self._launch_asked:
            return
        try:
            spec = launch_spec_for(self.profile, self.session)
        except (ValueError, TypeError) as exc:
            self.notify(f"cannot launch: {exc}", severity="error", timeout=12)
            return
        if self.on_connect == "launch":
            await self._launch(spec)
            return
        what = shlex.join(str(a) for a in spec.get("command", []))
        last = f"The last run, {run.get('run_id')}, is {run.get('state')}.\n" if run else ""

        def chosen(choice: str | None) -> None:
            if choice == "launch":
                self.run_worker(self._launch(spec), group="command", exit_on_error=False)

        self.push_screen(
            ConfirmScreen(
                f"No run is active on {self.session.target_display}. Launch one?",
                f"{last}Command: {what}\nThe run keeps going when you quit; `s` stops it.",
                [Choice("launch", "Launch", "success", "l"), Choice("no", "Not now", "default", "n")],
            ),
            chosen,
        )

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
        from tui.profiles import default_config_path

        config_file = Path(self.profiles_config).expanduser() if self.profiles_config else default_config_path()
        watched = live_reload.watched(config_file)

        def ready() -> None:
            self.post_message(LiveReloadReady([str(d) for d in watched.directories]))

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
        self._theme_names = list(dict.fromkeys([*self._theme_names, *loaded.themes]))
        if self.theme in changed_names:
            self.refresh_css(animate=False)
        for error in errors:
            self.notify(f"{error}; the theme loaded before stays", severity="error", timeout=15)
        if changed_names:
            self.notify(f"theme reloaded: {', '.join(changed_names)}", timeout=4)
        self.post_message(ThemesReloaded(changed_names, errors))

    def reload_profiles(self) -> None:
        """Read the profiles' config file again; a broken one is reported and the profile loaded before stays."""
        from tui.profiles import ProfileError, resolve_profile

        try:
            profile = resolve_profile(self.profile_name, self.profiles_config)
        except ProfileError as exc:
            self.notify(f"{exc}; the profiles loaded before stay", severity="error", timeout=15)
            self.post_message(ProfilesReloaded(None, str(exc)))
            return
        self.profile = profile.as_dict()
        self.notify(f"profile {profile.name} reloaded from {profile.source}", timeout=4)
        self.post_message(ProfilesReloaded(profile.name, None))

    # -- events in ---------------------------------------------------------------------------------

    def _on_agent_event(self, ev: dict[str, Any]) -> None:
        self.state.ingest(ev)
        if ev.get("ev") == "connection":
            self.post_message(ConnectionChanged.from_event(ev))

    def on_connection_changed(self, message: ConnectionChanged) -> None:
        """Drawn at once, not on the next flush: a lost link must show immediately."""
        if self.screen_stack and self.dashboard.ready:
            self.dashboard.query_one("#header").refresh()
        if message.state == "connected" and self.session.hello:
            self.state.ingest(self.session.hello)

    def flush_events(self, *, force_charts: bool = False) -> None:
        """Draw what arrived since the last flush (one batch, one frame)."""
        if not self.screen_stack or not self.dashboard.ready:
            return
        state = self.state
        state.header.rtt_ms = self.session.rtt_ms
        if state.header.state != self.session.state and self.session.state:
            state.header.state = self.session.state
            state.dirty.add("header")
        if not state.dirty and not state.notices and not state.pending_messages:
            return
        self.flushes += 1
        now = time.monotonic()
        charts_allowed = (
            force_charts or self.flush_interval_s is None or now - self._last_chart_draw >= self.chart_interval_s
        )
        if charts_allowed and ("charts" in state.dirty or state.charts.dirty):
            self._last_chart_draw = now
        sampled = state.gpus.get("t") if state.gpus is not None and "gpus" in state.dirty else None
        log_lines = state.new_log_lines
        state.new_log_lines = 0
        try:
            with self.batch_update():
                self.dashboard.apply(charts_allowed=charts_allowed)
        except NoMatches:
            return  # the panes are being torn down (the app is exiting)
        while state.notices:
            severity, text = state.notices.popleft()
            self.notify(text, severity=severity, timeout=8)  # type: ignore[arg-type]
        events = state.pending_messages
        state.pending_messages = []
        for ev in events:
            if ev.get("ev") == "run":
                run = ev.get("run")
                self.post_message(RunChanged(run if isinstance(run, dict) else None))
            elif ev.get("ev") == "milestone":
                t = ev.get("t")
                self.post_message(
                    MilestoneReached(
                        ev.get("run_id"),
                        str(ev.get("milestone")),
                        float(t) if isinstance(t, (int, float)) else None,
                        bool(ev.get("ok")),
                        ev.get("cause") if isinstance(ev.get("cause"), str) else None,
                    )
                )
        self.post_message(StreamBatch(events, log_lines))
        if isinstance(sampled, (int, float)):
            self.call_after_refresh(self._record_sample_latency, float(sampled))

    def _record_sample_latency(self, sampled_t: float) -> None:
        self.sample_latency_ms.append((time.time() - sampled_t) * 1000.0)

    # -- commands out ------------------------------------------------------------------------------

    async def _request(self, cmd: str, *, timeout_s: float | None = None, **args: Any) -> dict[str, Any] | None:
        try:
            result = await self.session.request(cmd, timeout_s=timeout_s, **args)
        except Exception as exc:  # CommandFailed or a lost link: a visible error, never a crash
            self.notify(f"{cmd} failed: {exc}", severity="error", timeout=12)
            self.post_message(CommandFinished(cmd, False, error=str(exc)))
            return None
        self.post_message(CommandFinished(cmd, True, result))
        return result

    def _confirm(self, title: str, body: str, on_yes: Callable[[], Any], yes_label: str = "Yes") -> None:
        def done(choice: str | None) -> None:
            if choice == "yes":
                on_yes()
            else:
                self.notify(f"{title.rstrip('?')}: cancelled", timeout=3)
                self.post_message(CommandFinished("confirm", False, error="cancelled"))

        self.push_screen(
            ConfirmScreen(
                title, body, [Choice("yes", yes_label, "error", "y"), Choice("no", "Cancel", "default", "n")]
            ),
            done,
        )

    def _run_label(self) -> str:
        run = self.state.run
        if not run:
            return "the run"
        return f"run {run.get('run_id')} ({shlex.join(str(a) for a in run.get('command') or [])})"

    def action_launch(self) -> None:
        self._launch_asked = True
        try:
            spec = launch_spec_for(self.profile, self.session)
        except (ValueError, TypeError) as exc:
            self.notify(f"cannot launch: {exc}", severity="error", timeout=12)
            return
        self.run_worker(self._launch(spec), group="command", exit_on_error=False)

    async def _launch(self, spec: dict[str, Any]) -> dict[str, Any] | None:
        self.notify(f"launching {shlex.join(str(a) for a in spec.get('command', []))}", timeout=4)
        result = await self._request("launch", timeout_s=60.0, **spec)
        if result is not None:
            self.notify(f"launched run {result.get('run_id')} (tmux {result.get('tmux_session')})", timeout=5)
        return result

    def action_restart(self) -> None:
        run = self.state.run
        if not run:
            self.notify("nothing to restart: no run yet (l launches the profile)", severity="warning")
            return
        body = (
            f"Stop {self._run_label()}, then launch its recorded command again:\n"
            f"  {shlex.join(str(a) for a in run.get('command') or [])}"
        )
        self._confirm("Restart the run?", body, self._start_restart, "Restart")

    def _start_restart(self) -> None:
        self.run_worker(self._restart(), group="command", exit_on_error=False)

    async def _restart(self) -> None:
        try:
            done = await restart_run(self.session)
        except Exception as exc:  # CommandFailed or a lost link: a visible error, never a crash
            self.notify(f"restart failed: {exc}", severity="error", timeout=12)
            self.post_message(CommandFinished("restart", False, error=str(exc)))
            return
        self.notify(f"restarted: run {done.run_id} (was {done.previous_run_id})", timeout=5)
        self.post_message(CommandFinished("restart", True, {"previous_run_id": done.previous_run_id, **done.launch}))

    def action_stop(self) -> None:
        if not self.state.run:
            self.notify("no run to stop", severity="warning")
            return
        body = f"Stop {self._run_label()}: SIGTERM to its process group, SIGKILL after the grace period."
        self._confirm("Stop the run?", body, self._start_stop, "Stop")

    def _start_stop(self) -> None:
        self.run_worker(self._stop(), group="command", exit_on_error=False)

    async def _stop(self) -> None:
        result = await self._request("stop", timeout_s=STOP_TIMEOUT_S)
        if result is not None:
            steps = "; ".join(str(s) for s in result.get("steps", []))
            self.notify(f"stopped: {steps}" if steps else "stopped", timeout=6)

    def action_kill_stale(self) -> None:
        self.run_worker(self._kill_stale(), group="command", exit_on_error=False)

    async def _kill_stale(self) -> None:
        listing = await self._request("kill_stale", timeout_s=30.0, dry_run=True, targets=None)
        if listing is None:
            return
        candidates = [c for c in listing.get("candidates", []) if isinstance(c, dict)]
        if not candidates:
            self.notify("no stale GPU holders", timeout=4)
            return

        def chosen(targets: list[list[Any]] | None) -> None:
            if not targets:
                self.notify("kill stale: cancelled, nothing signalled", timeout=4)
                self.post_message(CommandFinished("confirm", False, error="cancelled"))
                return
            self.run_worker(self._signal_stale(targets), group="command", exit_on_error=False)

        self.push_screen(KillStaleScreen(candidates), chosen)

    async def _signal_stale(self, targets: list[list[Any]]) -> None:
        result = await self._request("kill_stale", timeout_s=60.0, dry_run=False, targets=targets)
        if result is not None:
            signalled = result.get("signalled", [])
            failed = result.get("failed", [])
            severity: SeverityLevel = "warning" if failed else "information"
            self.notify(f"signalled {len(signalled)} process(es); {len(failed)} failed", severity=severity)

    def action_stacks(self) -> None:
        screen = StacksScreen()  # "dumping stacks…" at once; the host's reply fills it in
        self.push_screen(screen)
        self.run_worker(self._stacks(screen), group="command", exit_on_error=False)

    async def _stacks(self, screen: StacksScreen) -> None:
        try:
            result = await self.session.request(
                "stacks", timeout_s=STACKS_TIMEOUT_S + 5, params={"timeout_s": STACKS_TIMEOUT_S}
            )
        except Exception as exc:  # CommandFailed or a lost link: the reason replaces the pending text
            screen.show("failed", f"stacks failed: {exc}")
            self.post_message(CommandFinished("stacks", False, error=str(exc)))
            return
        screen.show(str(result.get("method", "?")), str(result.get("text", "")))
        self.post_message(CommandFinished("stacks", True, result))

    def action_runs(self) -> None:
        self.run_worker(self._runs(), group="command", exit_on_error=False)

    async def _runs(self) -> None:
        result = await self._request("runs", timeout_s=60.0, limit=RUNS_SHOWN)
        if result is not None:
            runs = [r for r in result.get("runs") or [] if isinstance(r, dict)]
            total = int(result.get("total") or len(runs))
            self.push_screen(RunsScreen(runs, total, self._run_tail))

    async def _run_tail(self, run_id: str) -> dict[str, Any] | None:
        return await self._request("tail", timeout_s=30.0, n=RUN_TAIL_LINES, run_id=run_id)

    def action_filter(self) -> None:
        self.dashboard.log_pane.open_filter()

    def action_follow(self) -> None:
        self.dashboard.log_pane.tail.action_follow()

    def action_next_theme(self) -> None:
        names = self._theme_names or [theming.DEFAULT_THEME]
        current = names.index(self.theme) if self.theme in names else -1
        self.theme = names[(current + 1) % len(names)]
        self.notify(f"theme: {self.theme} (saved)", timeout=3)

    def action_help(self) -> None:
        if not self.is_screen_installed("help"):
            self.install_screen(HelpScreen(self.user_keymap), "help")
        self.push_screen("help")

    async def action_quit_dashboard(self) -> None:
        run = self.state.run
        if run and run.get("state") in ("running", "starting"):
            message = (
                f"Left the dashboard. Run {run.get('run_id')} keeps running on {self.session.target_display}; "
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

    # -- attach ------------------------------------------------------------------------------------

    def action_attach(self) -> None:
        run = self.state.run
        tmux_session = run.get("tmux_session") if run else None
        if not run or not isinstance(tmux_session, str) or not run.get("attachable", True):
            self.notify("no tmux session to attach to (no run, or it was started without tmux)", severity="warning")
            return
        argv = self.session.attach_argv(tmux_session)
        if not os.environ.get("TMUX"):
            self._attach_here(argv)
            return
        plan = attach.plan_here(argv)
        if plan.hands_over_terminal:
            choices = [
                Choice("window", "New tmux window", "primary", "w"),
                Choice("here", "Use this terminal", "default", "h"),
                Choice("no", "Cancel", "default", "n"),
            ]
            body = f"You are inside tmux. Open the run in a new window instead of nesting?\n\n  {shlex.join(argv)}"
        else:  # the run's session lives on this very tmux server: switch to it, never nest
            choices = [Choice("here", "Use this terminal", "primary", "h"), Choice("no", "Cancel", "default", "n")]
            body = (
                f"The run's session {tmux_session} is on the tmux server you are in: this terminal switches to "
                f"it, and `tmux switch-client -l` (prefix L) comes back here.\n\n  {shlex.join(plan.argv)}"
            )

        def picked(choice: str | None) -> None:
            if choice == "window":
                self._attach_new_window(argv)
            elif choice == "here" and plan.hands_over_terminal:
                self._attach_here(plan.argv)
            elif choice == "here":
                self._switch_client(plan)

        self.push_screen(ConfirmScreen("Attach to the run", body, choices), picked)

    def _switch_client(self, plan: attach.HerePlan) -> None:
        """Same tmux server: point this client at the run's session; the dashboard keeps running in its pane."""
        self.attach_history.append(plan.argv)
        try:
            code = self.external_runner(plan.argv)
        except OSError as exc:
            failure = f"tmux switch-client failed: {exc}"
        else:
            failure = f"tmux switch-client exited {code}" if code != 0 else ""
        if failure:
            self.notify(f"{failure}; run: {shlex.join(plan.argv)}", severity="error", timeout=20)
        else:
            self.notify(plan.note, timeout=10)
        self.post_message(CommandFinished("attach", not failure, {"argv": plan.argv}, failure or None))

    def _attach_new_window(self, argv: list[str]) -> None:
        # The new window's shell inherits $TMUX; a local `tmux attach` refuses to nest unless it is unset.
        command = ["env", "-u", "TMUX", *argv] if argv and argv[0] == "tmux" else argv
        window = ["tmux", "new-window", "-n", "specdec-run", "--", *command]
        self.attach_history.append(window)
        try:
            code = self.external_runner(window)
        except OSError as exc:
            self.notify(f"tmux new-window failed: {exc}; run: {shlex.join(argv)}", severity="error", timeout=20)
            return
        if code != 0:
            self.notify(f"tmux new-window exited {code}; run: {shlex.join(argv)}", severity="error", timeout=20)

    def _attach_here(self, argv: list[str]) -> None:
        self.attach_history.append(argv)
        outcome: list[str] = []
        try:
            with self.suspend():
                try:  # nothing may escape the suspended block, or the app does not resume (textual #6692)
                    code = self.external_runner(argv)
                    if code != 0:
                        outcome.append(f"attach exited with status {code}")
                except OSError as exc:
                    outcome.append(f"attach failed: {exc}")
        except SuspendNotSupported:
            command = shlex.join(argv)
            self.push_screen(
                ConfirmScreen(
                    "Attach from a terminal",
                    f"This terminal cannot be handed over. In another terminal run:\n\n  {command}\n\n"
                    "Detach with Ctrl-b d; the run keeps going either way.",
                    [Choice("no", "Close", "primary")],
                )
            )
            self.post_message(CommandFinished("attach", False, {"argv": argv}, "suspend not supported"))
            return
        for line in outcome:
            self.notify(line, severity="warning", timeout=10)
        self.post_message(CommandFinished("attach", not outcome, {"argv": argv}))
        self.run_worker(self._resync(), name="resync", exit_on_error=False)

    async def _resync(self) -> None:
        """Back from an attach: the loop was blocked meanwhile, so re-check the link and the run."""
        self.state.header.state = self.session.state
        self.state.dirty.add("header")
        if self.session.state != "connected":
            return  # the session's reconnect loop is at work; the header shows its attempts
        status = await self._request("status", timeout_s=15.0)
        if status is not None:
            self.state.ingest_status(status)

    # -- command palette ---------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for spec in keys.KEY_TABLE:
            yield SystemCommand(spec.description, spec.tooltip, partial(self.run_action, spec.action))


def run_dashboard(
    session: SessionLike,
    *,
    profile: dict[str, Any] | None = None,
    theme: str | None = None,
    on_connect: str = "offer",
) -> int:
    """Run the dashboard on this terminal until the user quits; returns the process exit status.

    on_connect: "offer" asks to launch the profile's run when none is active, "launch" starts it, "none" waits.
    """
    app = DashboardApp(session, profile=profile, theme=theme, on_connect=on_connect, tune_gc=True, live_reload=True)
    app.run()
    return app.return_code if app.return_code is not None else 0
