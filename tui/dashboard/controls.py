"""What the dashboard's keys do, each owned by the object it acts on; the app only routes them.

``action_table`` is the routing: a key's action name (tui/dashboard/keys.py) to the method of its owner.

- ``RunControl``: the run's verbs, sent to the host (launch, restart, stop, kill stale, stacks, past runs, attach).
- ``ViewControl``: what changes this screen only (log filter, follow, theme, help).
- the app itself: leaving (quit), which ends the session and the app's life.

Every command runs in a worker, so the screen never waits on the network; its outcome is a notification (a
failed command an error one), never a crash.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from textual.app import App, SuspendNotSupported
from textual.notifications import SeverityLevel

from engine import protocol
from tui.dashboard import theming
from tui.dashboard.attach import HerePlan, plan_here, tmux_literal
from tui.dashboard.screens.confirm import Choice, ConfirmScreen
from tui.dashboard.screens.dashboard import DashboardScreen
from tui.dashboard.screens.help import HelpScreen
from tui.dashboard.screens.kill_stale import KillStaleScreen
from tui.dashboard.screens.runs import RUN_TAIL_LINES, RunsScreen
from tui.dashboard.screens.stacks import StacksScreen
from tui.dashboard.state import DashboardState, Dirty
from tui.hosttext import printable
from tui.link.session import AgentSession, typed_reply
from tui.profiles import Profile, ProfileError
from tui.relaunch import launch_spec, restart_run, session_profile

STOP_TIMEOUT_S = 120.0
STACKS_TIMEOUT_S = 20.0
RUNS_SHOWN = 50  # newest runs listed by the runs screen (the agent caches scans of 64 runs)

Handler = Callable[[], Awaitable[None] | None]
R = TypeVar("R")


def run_external(argv: list[str]) -> int:
    """Hand the terminal to ``argv`` (tmux attach, ssh -t ...) and return its exit status."""
    return subprocess.run(argv, check=False).returncode


class RunControl:
    """The run's verbs: each asks first where it changes the host, then sends its command in a worker."""

    def __init__(
        self,
        app: App[Any],
        session: AgentSession,
        state: DashboardState,
        profile: Callable[[], Profile | None],
        external_runner: Callable[[list[str]], int] = run_external,
    ) -> None:
        self.app = app
        self.session = session
        self.state = state
        self.profile = profile  # read at each launch: the profiles' file may have been reloaded
        self.external_runner = external_runner
        self.attach_history: list[list[str]] = []  # every argv handed the terminal (or a tmux window)
        self.launch_asked = False  # the user pressed launch: no offer on connect

    @property
    def readonly(self) -> bool:
        """Watching only (``connect --readonly``, a profile's ``readonly = true``): no key acts on the host."""
        return self.session.opts.readonly

    def refused(self, what: str) -> bool:
        """True, with a notice, when read-only mode forbids ``what``."""
        if self.readonly:
            self.app.notify(f"read-only: {what} is off in this dashboard (it only watches)", severity="warning")
        return self.readonly

    async def offer_launch(self, on_connect: str) -> None:
        """`connect --launch` starts the profile's run when none is active; plain `connect` offers it (neither in
        read-only mode)."""
        status = await self._request(protocol.StatusReply, "status", timeout_s=30.0)
        if status is not None:
            self.state.ingest_status(status)
        run = self.state.run
        if (run is not None and run.state in ("starting", "running")) or self.launch_asked or self.readonly:
            return
        spec = self._launch_spec()
        if spec is None:
            return
        if on_connect == "launch":
            await self._launch(spec)
            return
        what = shlex.join(spec.command)
        last = f"The last run, {run.run_id}, is {run.state}.\n" if run else ""

        def chosen(choice: str | None) -> None:
            if choice == "launch":
                self.app.run_worker(self._launch(spec), group="command", exit_on_error=False)

        self.app.push_screen(
            ConfirmScreen(
                f"No run is active on {self.session.target_display}. Launch one?",
                f"{last}Command: {what}\nThe run keeps going when you quit; `s` stops it.",
                [Choice("launch", "Launch", "success", "l"), Choice("no", "Not now", "default", "n")],
            ),
            chosen,
        )

    async def _request(self, reply: type[R], cmd: str, *, timeout_s: float | None = None, **args: Any) -> R | None:
        """Send ``cmd`` and decode its reply into ``reply``; None (and an error on screen) when either fails."""
        try:
            result = await self.session.request(cmd, timeout_s=timeout_s, **args)
            typed = typed_reply(reply, cmd, result)
        except Exception as exc:  # CommandFailed, a reply that does not decode, a lost link: an error, never a crash
            self.app.notify(f"{cmd} failed: {exc}", severity="error", timeout=12)
            return None
        return typed

    def _confirm(self, title: str, body: str, on_yes: Callable[[], Any], yes_label: str = "Yes") -> None:
        def done(choice: str | None) -> None:
            if choice == "yes":
                on_yes()
            else:
                self.app.notify(f"{title.rstrip('?')}: cancelled", timeout=3)

        self.app.push_screen(
            ConfirmScreen(
                title, body, [Choice("yes", yes_label, "error", "y"), Choice("no", "Cancel", "default", "n")]
            ),
            done,
        )

    def _run_label(self) -> str:
        run = self.state.run
        if not run:
            return "the run"
        return f"run {run.run_id} ({shlex.join(run.command)})"

    def _launch_spec(self) -> protocol.LaunchSpec | None:
        """The profile's launch on this host (the one the command line named when the app was given none); None,
        with the reason on screen, when the profiles' file cannot be used."""
        try:
            return launch_spec(self.profile() or session_profile(self.session), self.session)
        except ProfileError as exc:
            self.app.notify(f"cannot launch: {exc}", severity="error", timeout=12)
            return None

    def launch(self) -> None:
        self.launch_asked = True
        if self.refused("launch"):
            return
        spec = self._launch_spec()
        if spec is None:
            return
        run = self.state.run
        if run is not None and run.state in ("starting", "running"):
            # A second run becomes the current one on screen; the live one goes on out of sight, so ask first.
            body = (
                f"{self._run_label()} is still {run.state}. A second run starts beside it and becomes the one shown "
                f"here; the first goes on (`runs` lists it, `stop --run {run.run_id}` stops it).\n"
                f"Command: {shlex.join(spec.command)}"
            )
            self._confirm(
                "Launch a second run?",
                body,
                lambda: self.app.run_worker(self._launch(spec), group="command", exit_on_error=False),
                "Launch",
            )
            return
        self.app.run_worker(self._launch(spec), group="command", exit_on_error=False)

    async def _launch(self, spec: protocol.LaunchSpec) -> None:
        self.app.notify(f"launching {shlex.join(spec.command)}", timeout=4)
        result = await self._request(protocol.LaunchReply, "launch", timeout_s=60.0, **protocol.to_jsonable(spec))
        if result is not None:
            self.app.notify(f"launched run {result.run_id} (tmux {result.tmux_session})", timeout=5)

    def restart(self) -> None:
        if self.refused("restart"):
            return
        run = self.state.run
        if not run:
            self.app.notify("nothing to restart: no run yet (l launches the profile)", severity="warning")
            return
        body = f"Stop {self._run_label()}, then launch its recorded command again:\n  {shlex.join(run.command)}"
        self._confirm("Restart the run?", body, lambda: self._start_restart(run.run_id), "Restart")

    def _start_restart(self, run_id: str) -> None:
        self.app.run_worker(self._restart(run_id), group="command", exit_on_error=False)

    async def _restart(self, run_id: str) -> None:
        """Restart the run shown when the key was pressed, by its id (never a run that became current since)."""
        try:
            done = await restart_run(self.session, run_id=run_id)
        except Exception as exc:  # CommandFailed or a lost link: a visible error, never a crash
            self.app.notify(f"restart failed: {exc}", severity="error", timeout=12)
            return
        self.app.notify(f"restarted: run {done.run_id} (was {done.previous_run_id})", timeout=5)

    def stop(self) -> None:
        if self.refused("stop"):
            return
        run = self.state.run
        if not run:
            self.app.notify("no run to stop", severity="warning")
            return
        body = f"Stop {self._run_label()}: SIGTERM to its process group, SIGKILL after the grace period."
        self._confirm("Stop the run?", body, lambda: self._start_stop(run.run_id), "Stop")

    def _start_stop(self, run_id: str) -> None:
        self.app.run_worker(self._stop(run_id), group="command", exit_on_error=False)

    async def _stop(self, run_id: str) -> None:
        """Stop the run shown when the key was pressed, by its id (never a run that became current since)."""
        result = await self._request(protocol.StopReply, "stop", timeout_s=STOP_TIMEOUT_S, run_id=run_id)
        if result is not None:
            steps = "; ".join(result.steps)
            self.app.notify(f"stopped: {steps}" if steps else "stopped", timeout=6)

    def kill_stale(self) -> None:
        if self.refused("kill stale"):
            return
        self.app.run_worker(self._kill_stale(), group="command", exit_on_error=False)

    async def _kill_stale(self) -> None:
        listing = await self._request(protocol.KillStaleReply, "kill_stale", timeout_s=30.0, dry_run=True, targets=None)
        if listing is None:
            return
        candidates = listing.candidates
        if not candidates:
            self.app.notify("no stale GPU holders", timeout=4)
            return

        def chosen(targets: list[list[Any]] | None) -> None:
            if not targets:
                self.app.notify("kill stale: cancelled, nothing signalled", timeout=4)
                return
            self.app.run_worker(self._signal_stale(targets), group="command", exit_on_error=False)

        self.app.push_screen(KillStaleScreen(candidates), chosen)

    async def _signal_stale(self, targets: list[list[Any]]) -> None:
        result = await self._request(
            protocol.KillStaleReply, "kill_stale", timeout_s=60.0, dry_run=False, targets=targets
        )
        if result is not None:
            signalled, failed = result.signalled, result.failed
            severity: SeverityLevel = "warning" if failed else "information"
            self.app.notify(f"signalled {len(signalled)} process(es); {len(failed)} failed", severity=severity)

    def stacks(self) -> None:
        if self.refused("stack dumps"):  # a dump is asked for with a signal to the run's processes
            return
        screen = StacksScreen()  # "dumping stacks…" at once; the host's reply fills it in
        self.app.push_screen(screen)
        self.app.run_worker(self._stacks(screen), group="command", exit_on_error=False)

    async def _stacks(self, screen: StacksScreen) -> None:
        try:
            result = await self.session.request(
                "stacks", timeout_s=STACKS_TIMEOUT_S + 5, params={"timeout_s": STACKS_TIMEOUT_S}
            )
            stacks = typed_reply(protocol.StacksReply, "stacks", result)
        except Exception as exc:  # CommandFailed, a reply that does not decode, a lost link: the reason is shown
            screen.show("failed", f"stacks failed: {exc}")
            return
        screen.show(stacks.method, stacks.text)

    def serve_check(self) -> None:
        if self.refused("serve-check"):
            return
        run = self.state.run
        if run is not None and run.state in ("starting", "running"):
            self._confirm(
                "Serve check during the run?",
                "vLLM loads the run's target on this host beside the training and takes most of a GPU's memory: "
                "the run can run out of memory. The check is safe once the run has ended.",
                lambda: self.app.run_worker(self._serve_check(run_live=True), group="command", exit_on_error=False),
                "Check now",
            )
            return
        self.app.run_worker(self._serve_check(), group="command", exit_on_error=False)

    async def _serve_check(self, run_live: bool = False) -> None:
        started = await self._request(protocol.ServeCheckReply, "serve_check", timeout_s=30.0, run_live=run_live)
        if started is not None:
            self.app.notify(
                f"serve-check of {printable(Path(started.checkpoint).name)} started (pid {started.pid}); vLLM's τ "
                f"shows under the charts in a few minutes (log: {printable(started.log)})",
                timeout=10,
            )

    def runs(self) -> None:
        self.app.run_worker(self._runs(), group="command", exit_on_error=False)

    async def _runs(self) -> None:
        result = await self._request(protocol.RunsReply, "runs", timeout_s=60.0, limit=RUNS_SHOWN)
        if result is not None:
            self.app.push_screen(RunsScreen(result.runs, result.total or len(result.runs), self._run_tail))

    async def _run_tail(self, run_id: str) -> protocol.TailReply | None:
        return await self._request(protocol.TailReply, "tail", timeout_s=30.0, n=RUN_TAIL_LINES, run_id=run_id)

    def attach(self) -> None:
        run = self.state.run
        tmux_session = run.tmux_session if run else None
        if not run or tmux_session is None or not run.attachable:
            self.app.notify("no tmux session to attach to (no run, or it was started without tmux)", severity="warning")
            return
        argv = self.session.attach_argv(tmux_session)
        if not os.environ.get("TMUX"):
            self._attach_here(argv)
            return
        plan = plan_here(argv)
        if plan.hands_over_terminal:
            choices = [
                Choice("window", "New tmux window", "primary", "w"),
                Choice("here", "Use this terminal", "default", "h"),
                Choice("no", "Cancel", "default", "n"),
            ]
            body = f"You are inside tmux. Open the run in a new window instead of nesting?\n\n  {shlex.join(argv)}"
        elif self.readonly:  # switch-client has no read-only mode of its own: this client would type into the run
            self.app.notify(
                f"read-only: the run's session is on this tmux server; watch it from another terminal with "
                f"{shlex.join(argv)}",
                severity="warning",
                timeout=15,
            )
            return
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

        self.app.push_screen(ConfirmScreen("Attach to the run", body, choices), picked)

    def _switch_client(self, plan: HerePlan) -> None:
        """Same tmux server: point this client at the run's session; the dashboard keeps running in its pane."""
        self.attach_history.append(plan.argv)
        try:
            code = self.external_runner(plan.argv)
        except OSError as exc:
            failure = f"tmux switch-client failed: {exc}"
        else:
            failure = f"tmux switch-client exited {code}" if code != 0 else ""
        if failure:
            self.app.notify(f"{failure}; run: {shlex.join(plan.argv)}", severity="error", timeout=20)
        else:
            self.app.notify(plan.note, timeout=10)

    def _attach_new_window(self, argv: list[str]) -> None:
        # The new window's shell inherits $TMUX; a local `tmux attach` refuses to nest unless it is unset.
        command = ["env", "-u", "TMUX", *argv] if argv and argv[0] == "tmux" else argv
        try:
            window = ["tmux", "new-window", "-n", "specdec-run", "--", *(tmux_literal(a) for a in command)]
        except ValueError as exc:
            self.app.notify(f"cannot attach in a new window: {exc}; run: {shlex.join(argv)}", severity="error")
            return
        self.attach_history.append(window)
        try:
            code = self.external_runner(window)
        except OSError as exc:
            self.app.notify(f"tmux new-window failed: {exc}; run: {shlex.join(argv)}", severity="error", timeout=20)
            return
        if code != 0:
            self.app.notify(f"tmux new-window exited {code}; run: {shlex.join(argv)}", severity="error", timeout=20)

    def _attach_here(self, argv: list[str]) -> None:
        self.attach_history.append(argv)
        outcome: list[str] = []
        try:
            with self.app.suspend():
                try:  # nothing may escape the suspended block, or the app does not resume (textual #6692)
                    code = self.external_runner(argv)
                    if code != 0:
                        outcome.append(f"attach exited with status {code}")
                except OSError as exc:
                    outcome.append(f"attach failed: {exc}")
        except SuspendNotSupported:
            command = shlex.join(argv)
            self.app.push_screen(
                ConfirmScreen(
                    "Attach from a terminal",
                    f"This terminal cannot be handed over. In another terminal run:\n\n  {command}\n\n"
                    "Detach with Ctrl-b d; the run keeps going either way.",
                    [Choice("no", "Close", "primary")],
                )
            )
            return
        for line in outcome:
            self.app.notify(line, severity="warning", timeout=10)
        self.app.run_worker(self._resync(), name="resync", exit_on_error=False)

    async def _resync(self) -> None:
        """Back from an attach: the loop was blocked meanwhile, so re-check the link and the run."""
        self.state.header.state = self.session.state
        self.state.dirty.add(Dirty.HEADER)
        if self.session.state != "connected":
            return  # the session's reconnect loop is at work; the header shows its attempts
        status = await self._request(protocol.StatusReply, "status", timeout_s=15.0)
        if status is not None:
            self.state.ingest_status(status)


class ViewControl:
    """What changes this screen only: the log's filter and follow mode, the colour theme, the help screen."""

    def __init__(self, app: App[Any], dashboard: Callable[[], DashboardScreen], keymap: dict[str, str]) -> None:
        self.app = app
        self.dashboard = dashboard
        self.keymap = keymap
        self.theme_names: list[str] = []  # the order `t` cycles through (the app adds reloaded themes)

    def filter(self) -> None:
        self.dashboard().log_pane.open_filter()

    def follow(self) -> None:
        self.dashboard().log_pane.tail.action_follow()

    def next_theme(self) -> None:
        names = self.theme_names or [theming.DEFAULT_THEME]
        current = names.index(self.app.theme) if self.app.theme in names else -1
        self.app.theme = names[(current + 1) % len(names)]
        self.app.notify(f"theme: {self.app.theme} (saved)", timeout=3)

    def help(self) -> None:
        if not self.app.is_screen_installed("help"):
            self.app.install_screen(HelpScreen(self.keymap), "help")
        self.app.push_screen("help")


def action_table(run: RunControl, view: ViewControl, quit_: Handler) -> dict[str, Handler]:
    """Each key action (tui/dashboard/keys.py's ``action``) to the method of the object that owns it."""
    return {
        "launch": run.launch,
        "restart": run.restart,
        "stop": run.stop,
        "kill_stale": run.kill_stale,
        "attach": run.attach,
        "stacks": run.stacks,
        "serve_check": run.serve_check,
        "runs": run.runs,
        "filter": view.filter,
        "follow": view.follow,
        "next_theme": view.next_theme,
        "help": view.help,
        "quit_dashboard": quit_,
    }
