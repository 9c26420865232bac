"""The ``specdec-tui`` command line: connect (the dashboard) and the headless commands (README: Using it).

Exit codes: 0 ok; 1 the command or the run failed; 2 usage error (also a launch the host refused as bad
input: a cwd not there, a run id taken); 3 connection, authentication or host key failure; 4 ``launch --wait``:
deadline passed with the process alive but no progress.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tui.cli import monitor, nodes, run
from tui.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    Parser,
    UsageError,
    common_parser,
    connect_options,
    err,
    run_async,
)
from tui.link.session import ConnectError


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(  # its subcommands' parsers are Parsers too (argparse makes them of the parent's class)
        prog="specdec-tui",
        description="Launch, watch and rescue speculative-decoding drafter training on remote GPU hosts.",
        epilog="Exit codes: 0 ok, 1 failed, 2 usage, 3 connection/auth/host key, 4 hung (launch --wait).",
    )
    sub = parser.add_subparsers(dest="subcommand", metavar="COMMAND", required=True)
    common = common_parser()
    p = sub.add_parser("connect", parents=[common], help="the live dashboard")
    p.add_argument("--theme", metavar="NAME", help="colour theme")
    when = p.add_mutually_exclusive_group()
    when.add_argument(
        "--launch", action="store_true", help="start the profile's run if none is active (default: offer it)"
    )
    when.add_argument("--no-launch", action="store_true", help="never offer to launch; just watch")
    p.add_argument(
        "--readonly",
        action="store_true",
        help="watch only: no key launches, stops, restarts, kills or serve-checks (the agent refuses them too); "
        "tmux is attached read-only. A profile's readonly = true does the same",
    )
    p.set_defaults(func=None)
    run.add_parsers(sub, common)
    monitor.add_parsers(sub, common)
    return parser


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(options, COMMAND): everything after the first ``--`` is the command, verbatim."""
    argv = list(argv)
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


ACTING_VERBS = frozenset({"launch", "stop", "restart", "kill-stale", "stacks"})  # stacks signals the run's processes


def check_readonly(args: argparse.Namespace) -> None:
    """Read-only mode (``connect --readonly``, or the profile's ``readonly = true``): ``args.readonly`` set for the
    session; a verb that would launch, stop, restart, kill or signal (stacks) refused before anything connects (exit 2).
    ``kill-stale --dry-run`` only lists, and stays allowed."""
    from tui.profiles import ProfileError, resolve_profile

    wanted = bool(getattr(args, "readonly", False))
    acting = args.subcommand in ACTING_VERBS and not (args.subcommand == "kill-stale" and args.dry_run)
    if not (wanted or acting or args.subcommand == "connect"):
        return
    try:
        profile = resolve_profile(args.profile, args.config)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None
    args.readonly = wanted or profile.readonly
    why = "connect --readonly" if wanted else f"profile {profile.name} has readonly = true"
    if acting and args.readonly:
        raise UsageError(f"read-only ({why}): {args.subcommand} is refused; nothing was done")
    if args.subcommand == "connect" and args.readonly and args.launch:
        raise UsageError(f"read-only ({why}): --launch is refused; nothing was done")


def choose_targets(args: argparse.Namespace) -> bool:
    """Set ``args.target`` (the first TARGET, else the profile's first node); True when the command spans several
    nodes (several TARGETs, or none and a ``--profile`` with ``nodes``). Raises UsageError."""
    from tui.profiles import ProfileError, resolve_profile

    targets = list(args.targets)
    if not targets:
        try:
            profile = resolve_profile(args.profile, args.config)
        except ProfileError as exc:
            raise UsageError(str(exc)) from None
        if not profile.nodes:
            raise UsageError("a TARGET is needed (or --profile NAME of a profile with nodes)")
        targets = [n.target for n in profile.nodes]
        if len(targets) == 1:
            args.targets = targets
    args.target = targets[0]
    if len(targets) > 1 or not args.targets:
        nodes.check_multi(args.subcommand)
        return True
    return False


def cmd_connect(args: argparse.Namespace) -> int:
    from tui.link.session import ConnectError, open_session
    from tui.profiles import ProfileError, resolve_profile

    try:
        profile = resolve_profile(args.profile, args.config)
        session = open_session(args.target, connect_options(args))
    except (ProfileError, ValueError) as exc:
        raise UsageError(str(exc)) from None

    async def preflight() -> int:
        # Host key, auth and bootstrap problems end here with a message and exit 3, before any screen is drawn.
        probe = open_session(args.target, connect_options(args))
        try:
            await probe.connect()
        except ConnectError as exc:
            err(exc.message)
            return exc.exit_code
        await probe.close()
        return 0

    rc = run_async(preflight())
    if rc:
        return rc
    try:
        from tui.dashboard.app import run_dashboard
    except ImportError as exc:
        if exc.name not in ("tui.dashboard.app", "textual"):
            raise
        err(
            f"the dashboard is not available in this build ({exc}); "
            f"use the headless commands meanwhile: specdec-tui status {args.target}"
        )
        return EXIT_FAILED
    # The dashboard runs its own event loop and connects the session inside it.
    on_connect = "launch" if args.launch else "none" if args.no_launch else "offer"
    return int(run_dashboard(session, profile=profile, theme=args.theme, on_connect=on_connect))


def cmd_connect_nodes(args: argparse.Namespace) -> int:
    """The dashboard of one run across several nodes: every node's link is its own, shown on its line."""
    from tui.dashboard.nodes_app import run_nodes_dashboard
    from tui.profiles import ProfileError, resolve_profile

    try:
        profile = resolve_profile(args.profile, args.config)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None
    chosen = nodes.nodes_of(args, profile, connect_options(args))
    try:
        for node in chosen:
            node.open()
    except ValueError as exc:  # a malformed TARGET, before the screen is drawn
        raise UsageError(str(exc)) from None
    return run_nodes_dashboard(chosen, profile=profile, theme=args.theme)


def main(argv: Sequence[str] | None = None) -> int:
    opts, command = split_command(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(opts)  # exits 2 on a usage error
    if command and args.subcommand not in ("launch", "restart"):
        parser.error(f"`-- COMMAND` is only for launch and restart, not {args.subcommand}")
    args.command = command
    try:
        check_readonly(args)
        if choose_targets(args):
            if args.func is None:
                return cmd_connect_nodes(args)
            return run_async(nodes.run_nodes(args))
        if args.func is None:
            return cmd_connect(args)
        return run_async(args.func(args))
    except UsageError as exc:
        parser.print_usage(sys.stderr)
        err(f"specdec-tui {args.subcommand}: error: {exc}")
        return EXIT_USAGE
    except ConnectError as exc:  # raised before any connection (a passphrase prompt that got no right answer)
        err(exc.message)
        return exc.exit_code
    except BrokenPipeError:
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
