"""The headless commands over several nodes (tui/nodes.py): one launch, status, stop and restart, a merged log,
and kill-stale node by node.

A launch connects to every node before it starts anything: a node that cannot be reached is named and nothing
starts. It then launches node 0 (the rendezvous host) and the others under node 0's run id; a node whose launch
is refused is named and the nodes already started are stopped. ``--wait`` waits for every node; the first node
whose run fails (or hangs) ends the wait for all, every node is stopped, and the cause at the root (the node whose
own rank failed, not a survivor that saw its peer go) is the launch's cause.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

from engine import protocol
from tui.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_HUNG,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    err,
    print_json,
    say,
)
from tui.cli.run import kill_stale_on
from tui.hosttext import printable
from tui.link.events import ClientEvent, ConnectionEvent
from tui.link.session import CommandFailed, ConnectError, ConnectOptions
from tui.nodes import (
    Launched,
    Node,
    NodeRun,
    NodesError,
    RunChoice,
    choose_run,
    close_all,
    combined_run,
    connect_all,
    launch_run,
    node_cwd,
    resolve_nodes,
    stop_nodes,
    tag_line,
)
from tui.profiles import Profile


def nodes_of(args: argparse.Namespace, profile: Profile, base: ConnectOptions) -> list[Node]:
    try:
        return resolve_nodes(list(args.targets), profile, base)
    except NodesError as exc:
        raise UsageError(str(exc)) from None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else message


def _unreachable(failed: dict[str, ConnectError]) -> str:
    return "; ".join(f"node {label} unreachable: {_first_line(e.message)}" for label, e in failed.items())


class _NodeMilestones:
    """Prints each node's milestones as they arrive (human output only): ``[gpu-b] ✓ first-step  4.20 s``."""

    def __init__(self, node: Node, t0: float) -> None:
        self.node, self.t0 = node, t0
        self.run_id: str | None = None
        self.printed: set[tuple[str, bool]] = set()

    def __call__(self, ev: ClientEvent) -> None:
        if not isinstance(ev, protocol.MilestoneEvent) or (self.run_id and ev.run_id not in (None, self.run_id)):
            return
        if (ev.milestone, ev.ok) in self.printed:
            return
        self.printed.add((ev.milestone, ev.ok))
        say(f"  [{self.node.label}] {'✓' if ev.ok else '✗'} {ev.milestone:<11} {time.monotonic() - self.t0:6.2f} s")


def _launch_object(
    ok: bool, milestone: str, run_id: str | None, cause: str | None, t0: float, **extra: Any
) -> dict[str, Any]:
    return {
        "ok": ok,
        "milestone": milestone,
        "run_id": run_id,
        "cause": cause,
        "elapsed_s": round(time.monotonic() - t0, 3),
        **extra,
    }


def _node_object(node: Node, **fields: Any) -> dict[str, Any]:
    return {"node": node.label, "target": node.target, "node_rank": node.rank, **fields}


async def launch_nodes(
    args: argparse.Namespace,
    nodes: list[Node],
    profile: Profile,
    cwd: Callable[[Node], str | None],
    *,
    restart: bool = False,
) -> int:
    """``launch`` over ``nodes`` (exit codes as ``launch``: 0 reached, 1 failed, 3 a node unreachable, 4 hung);
    ``restart``: every node's run is stopped first (each must be reached, and stop), then the profile launched."""
    t0 = time.monotonic()
    as_json = bool(args.json)
    milestone = args.wait or "submitted"
    failed = await connect_all(nodes)
    try:
        if failed:
            cause = f"{_unreachable(failed)}; nothing was {'stopped or ' if restart else ''}started"
            if as_json:
                print_json(_launch_object(False, milestone, None, cause, t0, unreachable=sorted(failed)))
            else:
                err(f"FAILED: {cause}")
            return EXIT_CONNECTION
        if restart:
            chosen = await choose_run(nodes, getattr(args, "run", None))
            if chosen.ambiguous:
                err(f"not restarted: {chosen.why}; name the one to stop with --run")
                return EXIT_FAILED
            if chosen.run_id is None:
                if not as_json:
                    say(f"nothing to stop first: {chosen.why}")
                    _say_others(nodes, chosen.current, None)
            else:
                stopped = await stop_nodes(nodes, args.grace, chosen.run_id, missing_ok=True, current=chosen.current)
                for node, ok, text in stopped:
                    if not as_json:
                        say(f"[{node.label}] {'stopped' if ok else 'not stopped'}: {text}")
                if not all(ok for _, ok, _ in stopped):
                    err(f"run {chosen.run_id} did not stop on every node; not starting a new one")
                    return EXIT_FAILED
        printers = [_NodeMilestones(n, t0) for n in nodes]
        if not as_json:
            for n, pr in zip(nodes, printers, strict=True):
                assert n.session is not None
                n.session.add_event_listener(pr)

        def launched(node: Node, run_id: str, endpoint: str) -> None:
            printers[node.rank].run_id = run_id
            if not as_json:
                if node.rank == 0:
                    say(f"rendezvous at {endpoint} on {node.label}; {len(nodes)} nodes")
                say(f"launched run {run_id} on {node.label} (node {node.rank} of {len(nodes)})")

        command = list(getattr(args, "command", None) or []) or None
        done = await launch_run(
            nodes, profile, command=command, cwd=cwd, wait=args.wait, timeout_s=args.timeout, on_launched=launched
        )
    finally:
        await close_all(nodes)
    return _report_launch(args, nodes, done, t0)


def _report_launch(args: argparse.Namespace, nodes: list[Node], done: Launched, t0: float) -> int:
    milestone = args.wait or "submitted"
    per_node = [
        _node_object(
            n,
            **(
                {k: v for k, v in protocol.to_jsonable(done.results[n.label]).items() if k != "hung"}
                if n.label in done.results
                else {}
            ),
        )
        for n in nodes
    ]
    if done.ok:
        if args.json:
            print_json(_launch_object(True, milestone, done.run_id, None, t0, rendezvous=done.endpoint, nodes=per_node))
        elif args.wait:
            say(f"reached {args.wait} on all {len(nodes)} nodes in {time.monotonic() - t0:.2f} s")
        return EXIT_OK
    if args.json:
        print_json(
            _launch_object(
                False,
                milestone,
                done.run_id,
                done.cause,
                t0,
                failed_node=done.failed_node,
                failed_rank=done.failed_rank,
                rendezvous=done.endpoint,
                stopped=done.stopped,
                nodes=per_node,
            )
        )
    else:
        say(f"{'HUNG' if done.hung else 'FAILED'}: {printable(done.cause or '')}")
        if done.stopped:
            say(f"  stopped: {', '.join(done.stopped)}")
        for line in done.last_lines:
            say("    " + tag_line(done.failed_node or "?", str(line).rstrip("\n")))
    if done.hung:
        return EXIT_HUNG
    if done.bad_input:
        return EXIT_USAGE
    return EXIT_CONNECTION if done.lost else EXIT_FAILED


async def status_nodes(args: argparse.Namespace, nodes: list[Node]) -> int:
    """``status`` over ``nodes``: one object per node (its ``status`` as sent, or why it could not be asked) and
    the run's combined state. Exit 0 when every node answered, 3 when one could not be reached."""
    failed = await connect_all(nodes)
    try:

        async def ask(node: Node) -> tuple[dict[str, Any] | None, str | None]:
            if node.label in failed:
                return None, _first_line(failed[node.label].message)
            assert node.session is not None
            try:
                return await node.session.request("status", timeout_s=30.0), None
            except CommandFailed as exc:
                return None, exc.message

        answers = await asyncio.gather(*(ask(n) for n in nodes))
    finally:
        await close_all(nodes)
    parts: list[NodeRun] = []
    objs: list[dict[str, Any]] = []
    for node, (snap, problem) in zip(nodes, answers, strict=True):
        run = None
        if snap is not None and snap.get("run") is not None:
            run = protocol.decode_as(protocol.RunInfo, snap["run"])
        parts.append(NodeRun(node.label, run, problem))
        objs.append(_node_object(node, reachable=problem is None, error=problem, status=snap))
    combined = combined_run(parts)
    if args.json:
        print_json({"nodes": objs, "run": combined})
    else:
        say(
            f"run {combined['run_id'] or '-'}  state {combined['state']}  "
            f"{combined['running']}/{len(nodes)} nodes running"
        )
        if combined["cause"]:
            say(f"  cause {combined['cause']}")
        for node, part in zip(nodes, parts, strict=True):
            if part.error is not None:
                say(f"  [{node.label}] unreachable: {part.error}")
            elif part.run is None:
                say(f"  [{node.label}] no run")
            else:
                r = part.run
                step = f" step {r.last_step}" if r.last_step is not None else ""
                say(
                    f"  [{node.label}] node {node.rank}: run {r.run_id} {r.state}{step}"
                    + (f": {r.cause}" if r.cause else "")
                )
    return EXIT_CONNECTION if failed else EXIT_OK


def _say_others(nodes: list[Node], current: dict[str, protocol.RunInfo | None], run_id: str | None) -> None:
    """Name each node whose current run is another run than ``run_id``: reported, never touched."""
    for node in nodes:
        run = current.get(node.label)
        if run is not None and run.run_id != run_id:
            say(f"[{node.label}] current run {run.run_id} ({run.state}) is not a run over these nodes: not touched")


async def stop_all_nodes(args: argparse.Namespace, nodes: list[Node]) -> int:
    """``stop`` of one run on every node at once, by its id (``--run``, else the multi-node run the nodes' records
    name): never whatever a node runs now. A node that cannot be reached is named (exit 3), one not stopped, or no
    run to stop, exit 1."""
    failed = await connect_all(nodes)
    done: list[tuple[Node, bool, str]] = []
    try:
        reached = [n for n in nodes if n.label not in failed]
        chosen = await choose_run(reached, getattr(args, "run", None), len(nodes)) if reached else RunChoice(None)
        if chosen.run_id is not None:
            # a node without the run has none of it to stop: it is named, as is its own current run
            done = await stop_nodes(reached, args.grace, chosen.run_id, missing_ok=True, current=chosen.current)
    finally:
        await close_all(nodes)
    for label, exc in failed.items():
        err(f"[{label}] unreachable: {_first_line(exc.message)}")
    if chosen.run_id is None and reached:
        err(f"nothing stopped: {chosen.why}" + ("" if getattr(args, "run", None) else "; name the run with --run"))
        _say_others(reached, chosen.current, None)
        return EXIT_CONNECTION if failed else EXIT_FAILED
    for node, ok, text in done:
        say(f"[{node.label}] {'stopped' if ok else 'not stopped'}: {text}")
    if failed:
        return EXIT_CONNECTION
    return EXIT_OK if all(ok for _, ok, _ in done) else EXIT_FAILED


async def kill_stale_nodes(args: argparse.Namespace, nodes: list[Node]) -> int:
    """``kill-stale`` on every node, one after the other, each its own list (and with --yes its own signals)."""
    failed = await connect_all(nodes)
    objs: list[dict[str, Any]] = []
    code = EXIT_OK
    try:
        for node in nodes:
            if node.label in failed:
                problem = _first_line(failed[node.label].message)
                err(f"[{node.label}] unreachable: {problem}")
                objs.append(_node_object(node, error=problem))
                code = EXIT_CONNECTION
                continue
            assert node.session is not None
            try:
                rc, obj = await kill_stale_on(node.session, args, f"node {node.rank} {node.label}")
            except CommandFailed as exc:
                err(f"[{node.label}] {exc.message}")
                objs.append(_node_object(node, error=exc.message))
                code = max(code, EXIT_CONNECTION if exc.lost else EXIT_FAILED)
                continue
            objs.append(_node_object(node, **obj))
            code = max(code, rc)
    finally:
        await close_all(nodes)
    if args.json:
        print_json({"nodes": objs})
    return code


HELD_MAX_BYTES = 64 * 1024  # the longest partial line a node's log may keep waiting for its end


class _TaggedLines:
    """One node's log bytes cut into lines, each written tagged (tui/nodes.tag_line); a partial line waits."""

    def __init__(self, label: str, write: Callable[[str], None]) -> None:
        self.label, self.write = label, write
        self.held = b""

    def feed(self, data: bytes) -> None:
        *lines, self.held = (self.held + data).split(b"\n")
        if len(self.held) > HELD_MAX_BYTES:  # a line that never ends (a progress bar redrawn with \r) is cut, not kept
            lines.append(self.held)
            self.held = b""
        for line in lines:
            self.write(tag_line(self.label, printable(line.decode("utf-8", "replace").rstrip("\r"))))

    def flush(self) -> None:
        if self.held:
            self.feed(b"\n")


async def logs_nodes(args: argparse.Namespace, nodes: list[Node]) -> int:
    """``logs`` over ``nodes``: each node's last lines, tagged ``[node]`` or ``[node/rank R]``, node by node; with
    ``-f`` every node's new lines as they come (in order per node), each node on its own: a node that is down at
    the start is named and retried while the others stream, and each node's link reconnects on its own."""

    def write(line: str) -> None:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()

    streams = {n.label: _TaggedLines(n.label, write) for n in nodes}
    try:
        if args.follow:
            return await _follow_nodes(args, nodes, streams)
        failed = await connect_all(nodes)
        for label, exc in failed.items():
            err(f"[{label}] unreachable: {_first_line(exc.message)}")
        for node in nodes:
            if node.label not in failed:
                await _node_tail(args, node, streams[node.label])
        return EXIT_CONNECTION if failed else EXIT_OK
    finally:
        for stream in streams.values():
            stream.flush()
        await close_all(nodes)


async def _node_tail(args: argparse.Namespace, node: Node, stream: _TaggedLines) -> protocol.TailReply | None:
    """Print the node's last ``args.lines`` lines; the tail reply (None, said, when the node could not give it)."""
    assert node.session is not None
    params = {"run_id": args.run} if getattr(args, "run", None) else {}
    try:
        tail = await node.session.ask(protocol.TailReply, "tail", timeout_s=30.0, n=int(args.lines), **params)
    except CommandFailed as exc:
        err(f"[{node.label}] {exc.message}")
        return None
    for i, line in enumerate(tail.lines):
        cont = args.follow and tail.partial and i == len(tail.lines) - 1  # a follower continues that line
        stream.feed(protocol.decode_log_data(line) + (b"" if cont else b"\n"))
    return tail


async def _follow_nodes(args: argparse.Namespace, nodes: list[Node], streams: dict[str, _TaggedLines]) -> int:
    """``logs -f`` over ``nodes``, every node on its own task: connect (retried while down, each try said), print
    its last lines, then follow. Ends when no node is left to follow: exit 0 when each simply had nothing more to
    follow, 3 when a node's link failed for good."""
    try:
        for node in nodes:
            node.open()
    except ValueError as exc:
        raise NodesError(str(exc)) from None
    live = {n.label for n in nodes}
    lost: set[str] = set()
    ended = asyncio.Event()

    def done_with(label: str, failed: bool) -> None:
        live.discard(label)
        if failed:
            lost.add(label)
        if not live:
            ended.set()

    def listener(node: Node) -> Callable[[ClientEvent], None]:
        def on_event(ev: ClientEvent) -> None:
            if isinstance(ev, protocol.LogEvent):
                streams[node.label].feed(ev.raw)
            elif isinstance(ev, protocol.LogResetEvent):
                err(f"[{node.label}] [log {ev.reason}: following from byte {ev.offset}]")
            elif isinstance(ev, ConnectionEvent) and ev.state in ("reconnecting", "failed"):
                err(f"[{node.label}] [{ev.state}: {ev.detail}]")
            elif isinstance(ev, ConnectionEvent) and ev.detail.startswith("reconnected"):
                err(f"[{node.label}] [{ev.detail}]")

        return on_event

    async def follow(node: Node) -> None:
        session = node.session
        assert session is not None
        session.add_event_listener(listener(node))
        session.add_event_listener(
            lambda ev: done_with(node.label, True) if isinstance(ev, ConnectionEvent) and ev.state == "failed" else None
        )
        try:
            await session.connect(retry=True)  # a node down at the start: "[node] [reconnecting: ...]" per try
        except ConnectError as exc:  # for good (a host key, authentication): said by the listener
            done_with(node.label, True)
            if exc.retryable:
                err(f"[{node.label}] unreachable: {_first_line(exc.message)}")
            return
        session.auto_reconnect = True
        session.retry_lost_requests = True
        tail = await _node_tail(args, node, streams[node.label])
        if tail is None or not tail.current:
            done_with(node.label, tail is None)
            return
        session.resume_from({"offset": tail.offset, "inode": tail.inode} if tail.inode is not None else None, None)
        try:
            await session.start_streams(gpu_interval_s=5.0, procs_interval_s=5.0)
        except CommandFailed as exc:
            err(f"[{node.label}] {exc.message}")
            done_with(node.label, True)

    tasks = [asyncio.create_task(follow(n), name=f"follow-{n.label}") for n in nodes]
    for task in tasks:  # a bug in one node's task ends the command with its traceback, not a silent wait
        task.add_done_callback(lambda t: ended.set() if not t.cancelled() and t.exception() else None)
    try:
        await ended.wait()
        for task in tasks:
            failure = task.exception() if task.done() and not task.cancelled() else None
            if failure is not None:
                raise failure
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return EXIT_CONNECTION if lost else EXIT_OK


def check_multi(verb: str) -> None:
    if verb not in MULTI_VERBS:
        raise UsageError(f"{verb} takes one TARGET; several nodes are for {', '.join(sorted(MULTI_VERBS))}")


MULTI_VERBS = frozenset({"connect", "launch", "status", "stop", "restart", "logs", "kill-stale"})


def _cwd_for(args: argparse.Namespace, profile: Profile) -> Callable[[Node], str | None]:
    given = getattr(args, "cwd", None)  # `restart` has no --cwd: it starts where the profile says
    return lambda node: node_cwd(node, profile, given)


async def run_nodes(args: argparse.Namespace) -> int:
    """The command over several nodes (``args.targets``, else the profile's ``nodes``)."""
    from tui.cli.common import connect_options
    from tui.profiles import ProfileError, resolve_profile

    try:
        profile = resolve_profile(args.profile, args.config)
    except ProfileError as exc:
        raise UsageError(str(exc)) from None
    nodes = nodes_of(args, profile, connect_options(args))
    try:
        return await _run_verb(args, nodes, profile)
    except NodesError as exc:  # a malformed TARGET, found before any node is connected
        raise UsageError(str(exc)) from None


async def _run_verb(args: argparse.Namespace, nodes: list[Node], profile: Profile) -> int:
    if args.subcommand == "launch":
        return await launch_nodes(args, nodes, profile, _cwd_for(args, profile))
    if args.subcommand == "status":
        if getattr(args, "run", None):
            raise UsageError("status --run is for one TARGET")
        return await status_nodes(args, nodes)
    if args.subcommand == "stop":
        return await stop_all_nodes(args, nodes)
    if args.subcommand == "kill-stale":
        return await kill_stale_nodes(args, nodes)
    if args.subcommand == "restart":
        if args.command:
            raise UsageError("restart over several nodes launches the profile again; `-- COMMAND` is for launch")
        return await launch_nodes(args, nodes, profile, _cwd_for(args, profile), restart=True)
    return await logs_nodes(args, nodes)
