"""Headless commands that act: launch, stop, restart, kill-stale."""

from __future__ import annotations

import argparse
import os
import shlex
import time
from typing import Any

from engine import protocol
from tui.cli.common import (
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    err,
    positive_float,
    print_json,
    run_id_arg,
    say,
    simulated_label,
    with_session,
)
from tui.link.events import ClientEvent
from tui.link.session import CommandFailed, ReplyNotUnderstood, Session, typed_reply
from tui.profiles import Profile, ProfileError, resolve_profile
from tui.relaunch import launch_spec, restart_run

WAIT_CHOICES = ("started", "output", "first-step")
_REPLY_MARGIN_S = 30.0  # a wait's reply may arrive this long after its own timeout before we give up on it


def _profile(args: argparse.Namespace) -> Profile:
    try:
        return resolve_profile(args.profile, args.config)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None


def _wait_exit_code(result: protocol.WaitResult) -> int:
    if result.ok:
        return EXIT_OK
    # Hung means a deadline passed with the process alive; a live process with a dead engine thread failed.
    return EXIT_HUNG if result.hung else EXIT_FAILED


def _wait_object(result: protocol.WaitResult, run_id: str | None) -> dict[str, Any]:
    """The ``launch --wait --json`` object: the agent's WaitResult without ``hung`` (the exit code says that)."""
    return {
        "ok": result.ok,
        "milestone": result.milestone,
        "stage": result.stage,
        "cause": result.cause,
        "exit_code": result.exit_code,
        "signal": result.signal,
        "elapsed_s": result.elapsed_s,
        "last_lines": result.last_lines,
        "alive": result.alive,
        "detail": result.detail,
        "run_id": result.run_id or run_id,
    }


def _print_wait_human(obj: dict[str, Any], milestone: str) -> None:
    if obj["ok"]:
        say(f"reached {milestone} in {obj.get('elapsed_s') or 0:.2f} s")
        return
    say(f"{'HUNG' if obj.get('alive') else 'FAILED'}: {obj.get('cause')}")
    bits = []
    if obj.get("exit_code") is not None:
        bits.append(f"exit code {obj['exit_code']}")
    if obj.get("signal") is not None:
        bits.append(f"signal {obj['signal']}")
    if obj.get("detail"):
        bits.append(str(obj["detail"]))
    bits.append(f"last stage {obj.get('stage')}")
    if obj.get("elapsed_s") is not None:
        bits.append(f"after {obj['elapsed_s']:.2f} s")
    say("  " + ", ".join(bits))
    if obj["last_lines"]:
        say("  last lines of output.log:")
        for line in obj["last_lines"]:
            say("    " + str(line).rstrip("\n"))


class _MilestonePrinter:
    """Prints milestone events of one run as they arrive (human output only)."""

    def __init__(self, session: Session, enabled: bool) -> None:
        self.t0 = time.monotonic()
        self.run_id: str | None = None
        self.enabled = enabled
        self.printed: set[tuple[str, bool]] = set()
        self.unsubscribe = session.add_event_listener(self)

    def __call__(self, ev: ClientEvent) -> None:
        if not self.enabled or not isinstance(ev, protocol.MilestoneEvent):
            return
        if self.run_id is not None and ev.run_id not in (None, self.run_id):
            return
        key = (ev.milestone, ev.ok)
        if key in self.printed:
            return
        self.printed.add(key)
        say(f"  {'✓' if ev.ok else '✗'} {ev.milestone:<11} {time.monotonic() - self.t0:6.2f} s")


def _refused(wait: str | None, message: str, elapsed_s: float, as_json: bool, bad_input: bool = False) -> int:
    """A launch (or restart) the agent refused: exit 2 when the request itself was wrong (a cwd that is not there,
    a run id taken), 1 when it could not be carried out."""
    obj = {
        "ok": False,
        "milestone": wait or "submitted",
        "stage": "none",
        "cause": f"launch refused: {message}",
        "exit_code": None,
        "signal": None,
        "elapsed_s": round(elapsed_s, 3),
        "last_lines": [],
    }
    if as_json:
        print_json(obj)
    else:
        err(f"launch refused: {message}")
    return EXIT_USAGE if bad_input else EXIT_FAILED


async def wait_and_report(
    session: Session,
    launched: dict[str, Any],
    *,
    wait: str | None,
    timeout_s: float | None,
    deadlines_s: dict[str, float] | None,
    as_json: bool,
    printer: _MilestonePrinter,
) -> int:
    """After a launch: print where it runs, wait for the milestone if asked, map the result to an exit code.

    ``launched`` is the launch reply as sent (``--json`` carries its keys), ``command`` added by the client."""
    reply = typed_reply(protocol.LaunchReply, "launch", launched)
    run_id = reply.run_id
    printer.run_id = run_id or None
    attach = None
    if reply.attachable and reply.tmux_session:
        attach = shlex.join(session.attach_argv(reply.tmux_session))
    if not as_json:
        say(f"launched run {run_id} on {session.target_display}{simulated_label(session)}")
        if reply.command:
            say(f"  command {shlex.join(reply.command)}")
    if wait is None:
        if as_json:
            obj = {
                "ok": True,
                "milestone": "submitted",
                "stage": "submitted",
                "cause": None,
                "exit_code": None,
                "signal": None,
                "elapsed_s": round(time.monotonic() - printer.t0, 3),
                "last_lines": [],
            }
            print_json({**obj, **{k: v for k, v in launched.items() if k not in obj}})
        elif attach:
            say(f"  attach: {attach}")
        return EXIT_OK
    bound = timeout_s if timeout_s is not None else max((deadlines_s or {}).values(), default=3600.0)
    result = await session.ask(
        protocol.WaitResult,
        "wait",
        timeout_s=bound + _REPLY_MARGIN_S,
        params={"run_id": run_id, "milestone": wait, "timeout_s": timeout_s, "deadlines_s": deadlines_s},
    )
    obj = _wait_object(result, run_id or None)
    if as_json:
        print_json(obj)
    else:
        _print_wait_human(obj, wait)
        if attach:
            say(f"  attach: {attach}")
    return _wait_exit_code(result)  # the agent's answer: it says hung (the printed object leaves that out)


async def launch_and_wait(
    session: Session,
    spec: protocol.LaunchSpec,
    *,
    wait: str | None,
    timeout_s: float | None,
    as_json: bool,
) -> int:
    printer = _MilestonePrinter(session, enabled=not as_json)
    try:
        try:
            launched = await session.request("launch", timeout_s=60.0, **protocol.to_jsonable(spec))
        except CommandFailed as exc:
            if exc.lost:
                raise
            return _refused(wait, exc.message, time.monotonic() - printer.t0, as_json, exc.bad_input)
        launched.setdefault("command", spec.command)
        return await wait_and_report(
            session,
            launched,
            wait=wait,
            timeout_s=timeout_s,
            deadlines_s=spec.deadlines_s,
            as_json=as_json,
            printer=printer,
        )
    finally:
        printer.unsubscribe()


def launch_cwd(args: argparse.Namespace, profile_cwd: str | None) -> str | None:
    """Where the job starts: --cwd, else the profile's cwd, else (``local`` only) the directory the command was
    typed in, so a relative ``train.py`` means the file beside the user; None lets the host use its home."""
    local = args.target == "local" and args.pct is None
    cwd = getattr(args, "cwd", None)  # `restart` has no --cwd: it relaunches where the profile says
    if cwd:
        return os.path.abspath(os.path.expanduser(cwd)) if local else str(cwd)
    if profile_cwd:
        return profile_cwd
    return os.getcwd() if local else None


def _split_command(args: argparse.Namespace) -> list[str] | None:
    cmd = list(getattr(args, "command", None) or [])
    return cmd or None


async def cmd_launch(args: argparse.Namespace) -> int:
    profile = _profile(args)
    command = _split_command(args)

    async def body(session: Session) -> int:
        spec = launch_spec(profile, session, command=command, cwd=launch_cwd(args, profile.cwd))
        return await launch_and_wait(session, spec, wait=args.wait, timeout_s=args.timeout, as_json=args.json)

    return await with_session(args, body)


def _on_progress(ev: ClientEvent) -> None:
    if isinstance(ev, protocol.ProgressEvent):
        say(f"  … {ev.message}")


def _quiet(ev: ClientEvent) -> None:
    """A listener for --json: progress goes unsaid."""


async def _stop(session: Session, grace_s: float, quiet: bool = False, run_id: str | None = None) -> protocol.StopReply:
    """Stop run ``run_id`` (None: the host's current run)."""
    unsubscribe = session.add_event_listener(_on_progress if not quiet else _quiet)
    which: dict[str, Any] = {"run_id": run_id} if run_id is not None else {}
    try:
        return await session.ask(
            protocol.StopReply, "stop", timeout_s=grace_s + 120.0, grace_s=grace_s, release_timeout_s=30.0, **which
        )
    finally:
        unsubscribe()


async def _named_run(session: Session, run_id: str | None) -> protocol.RunInfo | None:
    """``--run ID`` as the host knows it (None without --run); an ID the host does not have is a usage error."""
    if run_id is None:
        return None
    try:
        return (await session.ask(protocol.RunInfoReply, "run_info", timeout_s=30.0, run_id=run_id)).run
    except CommandFailed as exc:
        if exc.lost:
            raise
        raise UsageError(f"--run {run_id}: {exc.message} (`specdec-tui runs TARGET` lists them)") from None


async def cmd_stop(args: argparse.Namespace) -> int:
    async def body(session: Session) -> int:
        named = await _named_run(session, args.run)
        if named is not None and named.state not in ("starting", "running"):
            say(f"run {named.run_id} had ended already ({named.state}); nothing to stop")
            return EXIT_OK
        result = await _stop(session, args.grace, run_id=args.run)
        which = f"run {args.run} " if args.run else ""
        say(f"{which}stopped" if result.stopped else f"{which}not stopped")
        return EXIT_OK if result.stopped else EXIT_FAILED

    return await with_session(args, body)


async def cmd_restart(args: argparse.Namespace) -> int:
    command = _split_command(args)
    explicit = args.profile is not None or command is not None
    profile = _profile(args) if explicit else None

    async def body(session: Session) -> int:
        if profile is None:
            # The agent relaunches the recorded spec (command, cwd, env, deadlines) under a new run id.
            printer = _MilestonePrinter(session, enabled=not args.json)
            progress = session.add_event_listener(_on_progress if not args.json else _quiet)
            try:
                try:
                    await _named_run(session, args.run)
                    done = await restart_run(session, grace_s=args.grace, run_id=args.run)
                except ReplyNotUnderstood as exc:  # the agent did restart; only its answer is unreadable
                    err(f"error: the restart was sent, but {exc.message}; see `specdec-tui runs` for the new run")
                    return EXIT_FAILED
                except CommandFailed as exc:
                    if exc.lost:
                        raise
                    return _refused(args.wait, exc.message, time.monotonic() - printer.t0, args.json, exc.bad_input)
                if not args.json:
                    say(f"previous run {done.previous_run_id}")
                return await wait_and_report(
                    session,
                    done.launch,
                    wait=args.wait,
                    timeout_s=args.timeout,
                    deadlines_s=None,
                    as_json=args.json,
                    printer=printer,
                )
            finally:
                progress()
                printer.unsubscribe()
        run = await _named_run(session, args.run)
        if run is None:
            run = (await session.ask(protocol.StatusReply, "status", timeout_s=30.0)).run
        if run is not None and run.state in ("starting", "running"):
            if not args.json:
                say(f"stopping run {run.run_id}")
            result = await _stop(session, args.grace, quiet=args.json, run_id=run.run_id)
            if not result.stopped:
                err("the run did not stop; not starting a new one")
                return EXIT_FAILED
        spec = launch_spec(profile, session, command=command, cwd=launch_cwd(args, profile.cwd))
        return await launch_and_wait(session, spec, wait=args.wait, timeout_s=args.timeout, as_json=args.json)

    return await with_session(args, body)


def _holder_rows(items: list[protocol.HolderInfo]) -> list[str]:
    out = []
    for h in items:
        mem_s = f"{h.used_mib:.0f} MiB" if h.used_mib is not None else "-"
        age_s = f"{h.age_s:.0f} s" if h.age_s is not None else "-"
        gpus = ",".join(str(g) for g in h.gpus) or "-"
        out.append(
            f"  pid {h.pid}  user {h.user or '-'}  gpus {gpus}  mem {mem_s}  age {age_s}"
            f"  state {h.state or '-'}  {(h.cmd or '')[:80]}"
        )
    return out


async def kill_stale_on(session: Session, args: argparse.Namespace, where: str) -> tuple[int, dict[str, Any]]:
    """``kill-stale`` on one host: lists its stale GPU holders (human output unless --json, headed ``where``),
    with --yes signals exactly those; returns the exit code and the ``--json`` object."""
    listed = await session.request("kill_stale", timeout_s=60.0, dry_run=True, targets=None, grace_s=args.grace)
    candidates = typed_reply(protocol.KillStaleReply, "kill_stale", listed).candidates
    raw_candidates = listed.get("candidates") or []  # what --json prints: the holders as the agent sent them
    if not args.json:
        say(f"stale GPU holders on {where}{simulated_label(session)}: {len(candidates)}")
        for line in _holder_rows(candidates):
            say(line)
    if args.dry_run or not candidates:
        if not args.json and args.dry_run and candidates:
            say("dry run: nothing signalled (use --yes to signal exactly these)")
        return EXIT_OK, {"dry_run": bool(args.dry_run), "candidates": raw_candidates, "signalled": [], "failed": []}
    targets = [[c.pid, c.create_time] for c in candidates]
    unsubscribe = session.add_event_listener(_on_progress if not args.json else _quiet)
    try:
        done = await session.ask(
            protocol.KillStaleReply,
            "kill_stale",
            timeout_s=args.grace + 120.0,
            dry_run=False,
            targets=targets,
            grace_s=args.grace,
        )
    finally:
        unsubscribe()
    signalled, failed = done.signalled, done.failed
    if not args.json:
        for s in signalled:
            say(f"  signalled {s}")
        for f in failed:
            say(f"  could not kill {f}")
    obj = {"dry_run": False, "candidates": raw_candidates, "signalled": signalled, "failed": failed}
    return (EXIT_OK if not failed else EXIT_FAILED), obj


async def cmd_kill_stale(args: argparse.Namespace) -> int:
    async def body(session: Session) -> int:
        code, obj = await kill_stale_on(session, args, session.target_display)
        if args.json:
            print_json(obj)
        return code

    return await with_session(args, body)


def _add_wait_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--wait", choices=WAIT_CHOICES, help="wait for this milestone (exit 0 reached, 1 failed, 2 bad input, 4 hung)"
    )
    p.add_argument("--timeout", type=positive_float, metavar="S", help="give up waiting after S seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")


RUN_HELP = (
    "that run (see `runs`), not the current one; over several nodes, the run's id on every node (default: the "
    "multi-node run the first node runs now)"
)
STEP_PATTERN_HELP = (
    "first-step for a foreign command: a line of its output matching the profile's step_pattern (default "
    "'step=\\d+'; a carriage return ends a line, so progress bars count). The step is the pattern's first "
    "capture group, else the first integer of the match: '\\d+/1000' reads '90/1000' as step 90."
)


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "launch",
        parents=[common],
        help="start the engine (or -- COMMAND) under supervision",
        usage="%(prog)s TARGET [opts] [--cwd DIR] [--wait started|output|first-step] [--timeout S] [--json]"
        " [-- COMMAND ...]",
        epilog=STEP_PATTERN_HELP,
    )
    _add_wait_opts(p)
    p.add_argument(
        "--cwd",
        metavar="DIR",
        help="the job's working directory on the host (default: the profile's cwd; for local, else the current "
        "directory; for a remote host, else its home)",
    )
    p.set_defaults(func=cmd_launch)

    p = sub.add_parser("stop", parents=[common], help="SIGTERM the run's process group, grace, SIGKILL")
    p.add_argument("--grace", type=positive_float, default=30.0, metavar="S", help="seconds before SIGKILL (30)")
    p.add_argument("--run", type=run_id_arg, metavar="ID", help=RUN_HELP)
    p.set_defaults(func=cmd_stop)

    p = sub.add_parser("restart", parents=[common], help="stop, then launch the same profile again")
    p.add_argument("--grace", type=positive_float, default=30.0, metavar="S", help="seconds before SIGKILL (30)")
    p.add_argument("--run", type=run_id_arg, metavar="ID", help=RUN_HELP)
    _add_wait_opts(p)
    p.set_defaults(func=cmd_restart)

    p = sub.add_parser("kill-stale", parents=[common], help="list (and with --yes signal) stale GPU holders")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--dry-run", action="store_true", help="only list them")
    mode.add_argument("--yes", action="store_true", help="list them, then signal exactly those")
    p.add_argument("--grace", type=positive_float, default=5.0, metavar="S", help="seconds between SIGTERM and SIGKILL")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_kill_stale)


__all__ = ["add_parsers", "kill_stale_on", "launch_and_wait"]
