"""What every headless command shares: the common options, one session per command, exit codes, output."""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

from engine import protocol
from tui.hosttext import printable, printable_lines
from tui.link.events import ConnectionEvent
from tui.link.session import CommandFailed, ConnectError, ConnectOptions, Session, open_session

EXIT_OK = protocol.EXIT_OK
EXIT_FAILED = protocol.EXIT_RUN_FAILED
EXIT_USAGE = protocol.EXIT_USAGE
EXIT_CONNECTION = protocol.EXIT_CONNECTION
EXIT_HUNG = protocol.EXIT_HUNG
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """Bad command-line input found after parsing (exit 2)."""


def _ctid(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 1_000_000_000:
        raise argparse.ArgumentTypeError(f"a Proxmox container id is a positive integer, got {text!r}")
    return int(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"a port is 1..65535, got {text!r}")
    return int(text)


def count_arg(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def gpu_count_arg(text: str) -> int:
    """``--simulate-gpus N``: 0 (off) to protocol.MAX_SIMULATED_GPUS."""
    count = count_arg(text)
    if count > protocol.MAX_SIMULATED_GPUS:
        raise argparse.ArgumentTypeError(f"at most {protocol.MAX_SIMULATED_GPUS} simulated GPUs, got {count}")
    return count


def run_id_arg(text: str) -> str:
    """A run id as the host names run directories (so it can never step out of <run-root>/runs)."""
    try:
        return protocol.validate_run_id(text)
    except protocol.RunIdError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


class Parser(argparse.ArgumentParser):
    """Every parser of the command line, subcommands' too: no abbreviated options (``--run`` must never be read as
    ``--run-root``, nor ``--read`` as anything)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def common_parser() -> Parser:
    p = Parser(add_help=False)
    g = p.add_argument_group("connection")
    g.add_argument(
        "targets",
        metavar="TARGET",
        nargs="*",
        help="local, [user@]host[:port], or a Host alias of ~/.ssh/config; several (or --profile NAME with nodes) "
        "for one run across them (launch, status, stop, logs)",
    )
    g.add_argument("--pct", type=_ctid, metavar="CTID", help="run everything inside Proxmox container CTID (pct exec)")
    g.add_argument("-i", "--identity", metavar="FILE", help="SSH private key")
    g.add_argument("-p", "--port", type=_port, metavar="N", help="SSH port")
    g.add_argument("--known-hosts", metavar="FILE", help="known_hosts file to verify the host key against")
    g.add_argument("--python", metavar="PATH", help="python interpreter on the host (default python3)")
    g.add_argument("--run-root", metavar="DIR", help="run root on the host (default ~/.specdec)")
    g.add_argument("--profile", metavar="NAME", help="run profile from the config file")
    g.add_argument("--config", metavar="FILE", help="config file with run profiles (TOML)")
    g.add_argument(
        "--simulate-gpus", type=gpu_count_arg, default=0, metavar="N", help="show N simulated GPUs (labelled simulated)"
    )
    g.add_argument(
        "--connect-timeout", type=positive_float, default=10.0, metavar="S", help="SSH connect timeout (default 10)"
    )
    return p


PASSPHRASE_TRIES = 3  # as ssh


def identity_passphrase(args: argparse.Namespace) -> str | None:
    """The passphrase of a passphrase-protected ``--identity``, asked for on the terminal (without echo) and checked
    against the key before any connection, as ssh does. Worked out once per command (the dashboard builds its
    options twice). None when the key has none, or when there is no terminal to ask on (the connection then fails
    with a sentence that says what to do). Raises ConnectError after three wrong answers or none."""
    if not hasattr(args, "_identity_passphrase"):
        identity = getattr(args, "identity", None)
        args._identity_passphrase = _ask_passphrase(identity) if identity else None
    return args._identity_passphrase


def _ask_passphrase(identity: str) -> str | None:
    import asyncssh

    path = os.path.expanduser(identity)
    try:
        asyncssh.read_private_key(path)
        return None  # not encrypted
    except (OSError, asyncssh.KeyEncryptionError):
        return None  # missing or unreadable: the transport says so
    except asyncssh.KeyImportError as exc:
        if "passphrase" not in str(exc).lower() or not (sys.stdin.isatty() and sys.stderr.isatty()):
            return None
    for _ in range(PASSPHRASE_TRIES):
        try:
            typed = getpass.getpass(f"Enter passphrase for key '{identity}': ", stream=sys.stderr)
        except (EOFError, KeyboardInterrupt):
            raise ConnectError(f"\nno passphrase given for {identity}; nothing was started", retryable=False) from None
        try:
            asyncssh.read_private_key(path, typed)
        except (asyncssh.KeyEncryptionError, asyncssh.KeyImportError):
            err("Incorrect passphrase.")
            continue
        return typed
    raise ConnectError(f"{identity}: {PASSPHRASE_TRIES} incorrect passphrases; nothing was started", retryable=False)


def connect_options(args: argparse.Namespace) -> ConnectOptions:
    if args.target == "local" and args.pct is None and args.run_root:
        root = os.path.expanduser(args.run_root)
        if os.path.exists(root) and not os.path.isdir(root):  # said here as bad input, before an agent starts
            raise UsageError(f"--run-root {args.run_root} is not a directory")
    if getattr(args, "profile", None) or getattr(args, "config", None):
        from tui.profiles import ProfileError, resolve_profile

        try:  # a verb that reads no profile still refuses one that is not there, rather than ignore it silently
            resolve_profile(args.profile, args.config)
        except ProfileError as exc:
            raise UsageError(str(exc)) from None
    return ConnectOptions(
        pct=args.pct,
        identity=args.identity,
        port=args.port,
        known_hosts=args.known_hosts,
        python=args.python,
        run_root=args.run_root,
        simulate_gpus=args.simulate_gpus,
        connect_timeout_s=args.connect_timeout,
        keepalive_s=15.0,
        profile=args.profile,
        config=args.config,
        passphrase=identity_passphrase(args) if args.target != "local" else None,
        readonly=bool(getattr(args, "readonly", False)),
    )


def say(message: str) -> None:
    """One line of a human command's output on stdout, host words made printable and kept on it: a newline in a
    host's words is shown, never a line break (a lying host must not print lines of its own; ``--json`` prints as
    sent)."""
    print(printable(message), flush=True)


def err(message: str) -> None:
    """A message for the person at the terminal; host words in it cannot reach the terminal as control sequences."""
    print(printable_lines(message), file=sys.stderr, flush=True)


def print_json(obj: Any, out: TextIO | None = None) -> None:
    out = out or sys.stdout
    out.write(json.dumps(protocol.to_jsonable(obj), indent=2, sort_keys=False) + "\n")
    out.flush()


SessionFn = Callable[[Session], Awaitable[int]]


def say_link_state(ev: object, failed: bool = True) -> None:
    """A following command's words on its link: "[reconnecting: why; retry in 0.4 s]", "[reconnected ...]" (and
    "[failed: ...]" unless the caller says the failure itself)."""
    if not isinstance(ev, ConnectionEvent):
        return
    if ev.state == "reconnecting" or (failed and ev.state == "failed"):
        err(f"[{ev.state}: {ev.detail}]")
    elif ev.state == "connected" and ev.detail.startswith("reconnected"):
        err(f"[{ev.detail}]")


async def with_session(args: argparse.Namespace, fn: SessionFn, *, reconnect: bool = False) -> int:
    """Connect, run ``fn``, close; map failures to exit codes (3 connection, 1 command failure)."""
    try:
        session = open_session(args.target, connect_options(args))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # A following command retries a drop while connecting as it retries one after: same backoff, same words.
    said = session.add_event_listener(lambda ev: say_link_state(ev, failed=False)) if reconnect else None
    try:
        await (session.connect(retry=True) if reconnect else session.connect())
    except ConnectError as exc:
        err(exc.message)
        return exc.exit_code
    finally:
        if said is not None:
            said()
    session.auto_reconnect = reconnect
    session.retry_lost_requests = reconnect
    try:
        return await fn(session)
    except CommandFailed as exc:
        err(f"error: {exc.message}")
        return EXIT_CONNECTION if exc.lost else EXIT_FAILED
    except ConnectError as exc:
        err(exc.message)
        return exc.exit_code
    finally:
        await session.close()


def run_async(coro: Awaitable[int]) -> int:
    async def main() -> int:
        return await coro

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def simulated_label(session: Session) -> str:
    return " (SIMULATED GPUs)" if session.agent and session.agent.simulated else ""
