"""One run across several machines: its nodes, the torchrun launch of each, and the run's combined state.

The nodes come from the command line (``launch gpu-a gpu-b``) or a profile (``nodes = [...]``); the first hosts
the c10d rendezvous. Every node runs the same run id; node r starts ``specdec-train --torchrun --nnodes N
--node-rank r --rdzv-endpoint ADDR:PORT`` (a foreign ``command`` gets the same words as SPECDEC_NNODES,
SPECDEC_NODE_RANK and SPECDEC_RDZV_ENDPOINT). The rendezvous address is the profile's, else the first node's
route to the others (as its agent sees it), at a port that agent checked is free.

The headless commands and the dashboard both hold one ``Node`` (a label, a target, its options, its session) per
machine; ``combined_run`` reads the nodes' run states as one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine import protocol
from tui.link.session import CommandFailed, ConnectError, ConnectOptions, Session, open_session
from tui.profiles import Node as ProfileNode
from tui.profiles import Profile
from tui.relaunch import launch_spec

ENV_NNODES = protocol.ENV_NNODES
ENV_NODE_RANK = protocol.ENV_NODE_RANK
ENV_RDZV_ENDPOINT = "SPECDEC_RDZV_ENDPOINT"
PEER_LEFT = "failed or left the run"  # how a surviving rank's cause names a peer that went away
LOST_NODE = "lost the node"  # how a node's wait says its link was lost
RENDEZVOUS_TIMEOUT_S = 30.0


class NodesError(ValueError):
    """The nodes cannot be worked out (a usage error: exit 2)."""


class RendezvousError(Exception):
    """The first node cannot host the rendezvous as asked (the profile's port is taken there)."""


@dataclass
class Node:
    """One machine of the run: ``label`` as every line names it, the TARGET, its options, once connected its
    session."""

    label: str
    target: str
    opts: ConnectOptions
    rank: int
    session: Session | None = None

    def open(self) -> Session:
        """A session for this node (not yet connected); raises ValueError for a malformed TARGET."""
        self.session = open_session(self.target, self.opts)
        return self.session


def _label(target: str, node: ProfileNode | None) -> str:
    label = target
    if node is not None and node.port is not None and ":" not in target:
        label += f":{node.port}"
    if node is not None and node.pct is not None:
        label += f"/ct{node.pct}"
    return label


def resolve_nodes(targets: list[str], profile: Profile, base: ConnectOptions) -> list[Node]:
    """The run's nodes: the TARGETs given (each with the command line's options), else the profile's ``nodes``
    (each node's own options over the command line's). Raises NodesError when there are none."""
    if targets:
        pairs: list[tuple[str, ProfileNode | None]] = [(t, None) for t in targets]
    elif profile.nodes:
        pairs = [(n.target, n) for n in profile.nodes]
    else:
        raise NodesError(f"no TARGET given, and profile {profile.name!r} names no nodes")
    out: list[Node] = []
    seen: dict[str, int] = {}
    for rank, (target, pn) in enumerate(pairs):
        opts = base
        if pn is not None:
            own = {k: v for k, v in dataclasses.asdict(pn).items() if k != "target" and v is not None}
            opts = dataclasses.replace(base, **own)
        label = _label(target, pn)
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        out.append(Node(label=label, target=target, opts=opts, rank=rank))
    return out


async def connect_all(nodes: list[Node], *, retry: bool = False) -> dict[str, ConnectError]:
    """Connect every node at once; returns the nodes that could not be reached, by label, with their error (the
    others stay connected). Raises NodesError for a malformed TARGET, before connecting any."""
    try:
        sessions = [n.open() for n in nodes]
    except ValueError as exc:
        raise NodesError(str(exc)) from None
    results = await asyncio.gather(
        *((s.connect(retry=True) if retry else s.connect()) for s in sessions), return_exceptions=True
    )
    failed: dict[str, ConnectError] = {}
    for node, res in zip(nodes, results, strict=True):
        if isinstance(res, ConnectError):
            failed[node.label] = res
        elif isinstance(res, BaseException):
            raise res
    return failed


async def close_all(nodes: list[Node]) -> None:
    await asyncio.gather(*(n.session.close() for n in nodes if n.session is not None), return_exceptions=True)


def _session(node: Node) -> Session:
    if node.session is None:
        raise RuntimeError(f"node {node.label} is not connected")
    return node.session


async def rendezvous_endpoint(nodes: list[Node], profile: Profile) -> str:
    """``ADDR:PORT`` of the c10d rendezvous on the first node: the profile's address, else the first node's route
    to the others; the profile's port (RendezvousError when it is taken there), else 29500 when free there, else
    one the kernel gives."""
    first = nodes[0]
    asked = await asyncio.gather(
        *(_session(n).ask(protocol.RendezvousReply, "rendezvous", timeout_s=RENDEZVOUS_TIMEOUT_S) for n in nodes)
    )
    # A node reached without SSH is the client's machine: the first node sees it as its SSH client (loopback when
    # the first node is this machine too).
    client = asked[0].ssh_client or "127.0.0.1"
    peers = [r.ssh_address or client for r in asked[1:]]
    here = await _session(first).ask(
        protocol.RendezvousReply,
        "rendezvous",
        timeout_s=RENDEZVOUS_TIMEOUT_S,
        peers=peers,
        port=profile.rendezvous.port,
        pick_port=True,
    )
    if here.port is None:
        raise RendezvousError(f"node {first.label}: its agent picked no rendezvous port")
    if profile.rendezvous.port is not None and here.port != profile.rendezvous.port:
        raise RendezvousError(
            f"node {first.label}: rendezvous port {profile.rendezvous.port} (profile {profile.name}) is in use there"
        )
    address = profile.rendezvous.address
    if address is None:
        routed = [here.routes.get(p) for p in peers]
        address = next((a for a in routed if a), None) or here.ssh_address or "127.0.0.1"
    host = f"[{address}]" if ":" in address else address
    return f"{host}:{here.port}"


def node_cwd(node: Node, profile: Profile, given: str | None = None) -> str | None:
    """Where a node's job starts: ``given`` (--cwd), else the profile's cwd, else (a ``local`` node) the directory
    the command was typed in; None lets the node use its home."""
    local = node.target == "local" and node.opts.pct is None
    if given:
        return os.path.abspath(os.path.expanduser(given)) if local else given
    if profile.cwd:
        return profile.cwd
    return os.getcwd() if local else None


def node_spec(
    profile: Profile,
    node: Node,
    *,
    nnodes: int,
    endpoint: str,
    run_id: str | None,
    command: list[str] | None = None,
    cwd: str | None = None,
) -> protocol.LaunchSpec:
    """Node ``node.rank``'s launch: the profile's engine as torchrun over ``nnodes`` nodes meeting at
    ``endpoint`` (a foreign command as it is, told the same in its environment), under ``run_id``."""
    spec = launch_spec(profile, _session(node), command=command, cwd=cwd)
    spec.run_id = run_id
    if command is None and profile.command is None:
        at = spec.command.index("engine.trainer") + 1
        spec.command[at:at] = [
            "--torchrun", "--nnodes", str(nnodes), "--node-rank", str(node.rank), "--rdzv-endpoint", endpoint,
        ]  # fmt: skip
    spec.env.update({ENV_NNODES: str(nnodes), ENV_NODE_RANK: str(node.rank), ENV_RDZV_ENDPOINT: endpoint})
    return spec


async def _run_of(node: Node, run_id: str | None = None) -> protocol.RunInfo | None:
    """The node's run ``run_id`` (None: its current run); None when it has none (or cannot say: the stop by id then
    says why)."""
    which: dict[str, Any] = {"run_id": run_id} if run_id is not None else {}
    try:
        return (await _session(node).ask(protocol.RunInfoReply, "run_info", timeout_s=30.0, **which)).run
    except CommandFailed:
        return None


def _part_of(run: protocol.RunInfo | None, node: Node, nnodes: int) -> bool:
    """``run`` is a run launched over these nodes, this node's part of it (as its launch recorded)."""
    return run is not None and run.nnodes == nnodes and run.node_rank == node.rank


@dataclass
class RunChoice:
    """The run a stop or restart over several nodes means: ``run_id`` (None: none found, ``why``), and each node's
    current run as it was asked (by label)."""

    run_id: str | None
    why: str | None = None
    current: dict[str, protocol.RunInfo | None] = field(default_factory=dict)
    ambiguous: bool = False  # several runs over these nodes are current: only --run can say which


async def choose_run(nodes: list[Node], run_id: str | None = None, nnodes: int | None = None) -> RunChoice:
    """The run a stop or restart over ``nodes`` (those of the ``nnodes`` connected) means: ``run_id`` when given
    (``--run``), else the multi-node run over these nodes that the first node runs now, else the one another node's
    current run is part of. Never "whatever each node runs now": a node's current run may be another run."""
    total = nnodes if nnodes is not None else len(nodes)
    asked = await asyncio.gather(*(_run_of(n) for n in nodes))
    current = {n.label: run for n, run in zip(nodes, asked, strict=True)}
    if run_id is not None:
        named = await asyncio.gather(*(_run_of(n, run_id) for n in nodes))
        if not any(named):
            return RunChoice(None, f"no node has a run {run_id}", current)
        return RunChoice(run_id, current=current)
    parts = {n.rank: run.run_id for n, run in zip(nodes, asked, strict=True) if run and _part_of(run, n, total)}
    ids = sorted(set(parts.values()))
    if 0 in parts:
        candidate = parts[0]
    elif len(ids) == 1:
        candidate = ids[0]
    elif ids:
        why = f"the nodes' current runs are different runs over {total} nodes ({', '.join(ids)})"
        return RunChoice(None, why, current, ambiguous=True)
    else:
        return RunChoice(None, f"no node's current run is a run over these {total} nodes", current)
    # A run over as many nodes at the same ranks may be another profile's (one that shares node 0): this profile's
    # run has its id, with its rank, on every node reached.
    held = await asyncio.gather(*(_run_of(n, candidate) for n in nodes))
    lacking = [n for n, run in zip(nodes, held, strict=True) if not _part_of(run, n, total)]
    if lacking:
        names = ", ".join(f"{n.label} (rank {n.rank})" for n in lacking)
        why = f"run {candidate} is not over these nodes: {names} has no part of it"
        return RunChoice(None, why, current, ambiguous=True)
    return RunChoice(candidate, current=current)


async def _stop_one(
    node: Node, grace_s: float, missing_ok: bool, run_id: str, current: protocol.RunInfo | None
) -> tuple[bool, str]:
    """Stop ``node``'s part of run ``run_id``, by that id (never the node's current run): (stopped, what was said).
    A part that already ended there counts as stopped (a rank's death ends its peers' parts too); a node without
    the run has nothing of it to stop (fine when ``missing_ok``: a restart, or a stop of a run another node has),
    and its own current run, another run, is only named."""
    session = _session(node)
    other = (
        f"; its current run {current.run_id} ({current.state}) is another run, left as it is"
        if current is not None and current.run_id != run_id
        else ""
    )
    try:
        try:
            run = (await session.ask(protocol.RunInfoReply, "run_info", timeout_s=30.0, run_id=run_id)).run
        except CommandFailed as exc:
            if missing_ok and not exc.lost:
                return True, f"no run {run_id} there, nothing stopped{other}"
            raise
        if run.state not in ("starting", "running"):
            return True, f"run {run.run_id} had ended already ({run.state}){other}"
        res = await session.ask(
            protocol.StopReply,
            "stop",
            timeout_s=grace_s + 120.0,
            grace_s=grace_s,
            release_timeout_s=30.0,
            run_id=run_id,
        )
    except CommandFailed as exc:
        return False, f"run {run_id}: {exc.message}{other}"
    said = "; ".join(res.steps[-1:]) if res.steps else ("stopped" if res.stopped else "not stopped")
    return res.stopped, f"run {run_id}: {said}{other}"


async def stop_nodes(
    nodes: list[Node],
    grace_s: float,
    run_id: str,
    *,
    missing_ok: bool = False,
    current: dict[str, protocol.RunInfo | None] | None = None,
) -> list[tuple[Node, bool, str]]:
    """Stop run ``run_id`` on every node at once, by its id (``current``: each node's current run, by label, to
    name one that is another run): (node, stopped, what was said) for each."""
    now = current or {}
    said = await asyncio.gather(*(_stop_one(n, grace_s, missing_ok, run_id, now.get(n.label)) for n in nodes))
    return [(n, ok, text) for n, (ok, text) in zip(nodes, said, strict=True)]


STOP_GRACE_ON_FAILURE_S = 10.0  # a launch that failed somewhere stops the other nodes with this grace
AFTER_STOP_WAIT_S = 60.0  # how long the other nodes' waits may take to end once every node was told to stop
_REPLY_MARGIN_S = 30.0


@dataclass
class Launched:
    """What one launch over every node came to (``launch_run``)."""

    ok: bool
    run_id: str | None = None
    endpoint: str | None = None
    cause: str | None = None  # "node LABEL: ..." when not ok
    failed_node: str | None = None
    failed_rank: int | None = None
    hung: bool = False  # the failing node's deadline passed with its process alive
    lost: bool = False  # a node's link was lost
    bad_input: bool = False  # a node refused the launch because the request itself was wrong (exit 2)
    stopped: list[str] = field(default_factory=list)  # the nodes stopped because of the failure
    results: dict[str, protocol.WaitResult] = field(default_factory=dict)  # each node's wait, by label
    last_lines: list[str] = field(default_factory=list)  # the failing node's


async def _wait_one(
    node: Node, run_id: str, milestone: str, timeout_s: float | None, deadlines: dict[str, float]
) -> protocol.WaitResult:
    bound = timeout_s if timeout_s is not None else max(deadlines.values(), default=3600.0)
    try:
        return await _session(node).ask(
            protocol.WaitResult,
            "wait",
            timeout_s=bound + _REPLY_MARGIN_S,
            params={"run_id": run_id, "milestone": milestone, "timeout_s": timeout_s, "deadlines_s": deadlines},
        )
    except CommandFailed as exc:
        return protocol.WaitResult(
            ok=False,
            milestone=milestone,
            stage="unknown",
            cause=f"{LOST_NODE}: {exc.message}",
            exit_code=None,
            signal=None,
            elapsed_s=0.0,
        )


def _root_failure(order: list[str], results: dict[str, protocol.WaitResult]) -> str:
    """The node at the root of a failed wait: the first to fail whose cause is its own (not a peer gone)."""
    failed = [label for label in order if not results[label].ok]
    own = [label for label in failed if PEER_LEFT not in (results[label].cause or "")]
    return (own or failed)[0]


def _failed_rank(res: protocol.WaitResult) -> int | None:
    """The global rank a torchrun cause names first ("rank 1 (node 1) ..."), None when it names none."""
    cause = res.cause or ""
    if cause.startswith("rank "):
        word = cause[5:].split(" ", 1)[0]
        if word.isdigit():
            return int(word)
    return None


async def launch_run(
    nodes: list[Node],
    profile: Profile,
    *,
    command: list[str] | None,
    cwd: Callable[[Node], str | None],
    wait: str | None,
    timeout_s: float | None,
    on_launched: Callable[[Node, str, str], None] | None = None,
) -> Launched:
    """Launch one run over ``nodes`` (every one connected): the rendezvous on the first, node 0 first and the
    others under its run id, then (``wait``) wait for the milestone on every node. A refused launch or the first
    failed wait stops every node started; the cause at the root is named (``_root_failure``). ``on_launched``
    hears each node started (node, run id, endpoint)."""
    try:
        endpoint = await rendezvous_endpoint(nodes, profile)
    except RendezvousError as exc:
        return Launched(False, cause=f"{exc}; nothing was started")
    except CommandFailed as exc:
        return Launched(False, cause=f"rendezvous: {exc.message}; nothing was started", lost=exc.lost)
    started: list[Node] = []
    run_id: str | None = None
    for node in nodes:
        spec = node_spec(
            profile, node, nnodes=len(nodes), endpoint=endpoint, run_id=run_id, command=command, cwd=cwd(node)
        )
        try:
            reply = await _session(node).request("launch", timeout_s=60.0, **protocol.to_jsonable(spec))
        except CommandFailed as exc:
            stopped = await stop_nodes(started, STOP_GRACE_ON_FAILURE_S, run_id) if run_id is not None else []
            then = f"stopped {', '.join(n.label for n, _, _ in stopped)}" if stopped else "nothing was started"
            return Launched(
                False,
                run_id=run_id,
                endpoint=endpoint,
                cause=f"node {node.label}: launch refused: {exc.message}; {then}",
                failed_node=node.label,
                lost=exc.lost,
                bad_input=exc.bad_input,
                stopped=[n.label for n, _, _ in stopped],
            )
        run_id = run_id or str(reply["run_id"])
        started.append(node)
        if on_launched is not None:
            on_launched(node, run_id, endpoint)
    assert run_id is not None
    if wait is None:
        return Launched(True, run_id=run_id, endpoint=endpoint)
    return await _wait_every_node(nodes, run_id, endpoint, wait, timeout_s, dict(profile.deadlines_s))


async def _wait_every_node(
    nodes: list[Node], run_id: str, endpoint: str, wait: str, timeout_s: float | None, deadlines: dict[str, float]
) -> Launched:
    tasks = {asyncio.create_task(_wait_one(n, run_id, wait, timeout_s, deadlines)): n for n in nodes}
    results: dict[str, protocol.WaitResult] = {}
    order: list[str] = []  # labels in the order their waits ended
    pending: set[asyncio.Task[protocol.WaitResult]] = set(tasks)
    stopped: list[tuple[Node, bool, str]] = []
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            results[tasks[task].label] = task.result()
            order.append(tasks[task].label)
        if pending and any(not r.ok for r in results.values()):
            # Nothing left running half-launched: every node is told to stop; their waits then end in their words.
            stopped = await stop_nodes(nodes, STOP_GRACE_ON_FAILURE_S, run_id)
            done, pending = await asyncio.wait(pending, timeout=AFTER_STOP_WAIT_S)
            for task in done:
                results[tasks[task].label] = task.result()
                order.append(tasks[task].label)
            for task in pending:
                task.cancel()
            pending = set()
    if all(r.ok for r in results.values()) and len(results) == len(nodes):
        return Launched(True, run_id=run_id, endpoint=endpoint, results=results)
    root = _root_failure(order, results)
    res = results[root]
    if not stopped:
        stopped = await stop_nodes(nodes, STOP_GRACE_ON_FAILURE_S, run_id)
    return Launched(
        False,
        run_id=run_id,
        endpoint=endpoint,
        cause=f"node {root}: {res.cause}",
        failed_node=root,
        failed_rank=_failed_rank(res),
        hung=res.hung,
        lost=(res.cause or "").startswith(LOST_NODE),
        stopped=[n.label for n, _, _ in stopped],
        results=results,
        last_lines=list(res.last_lines),
    )


@dataclass
class NodeRun:
    """One node's part of the run, as its ``status`` says (None: the node could not be asked, ``error`` why)."""

    label: str
    run: protocol.RunInfo | None
    error: str | None = None


def _is_peer_echo(cause: str | None) -> bool:
    return cause is not None and PEER_LEFT in cause


def combined_run(parts: list[NodeRun], rank_nodes: dict[int, str] | None = None) -> dict[str, Any]:
    """The run over every node as one: ``state`` (failed when any node's part failed; unreachable when a node
    could not be asked; running when every part runs; else starting, or ended), the run id(s), and for a failure
    the node, the rank and the cause at its root (a node whose own rank failed, before one that saw a peer go).

    ``rank_nodes`` (global rank -> node label, when known): while only a survivor has said that a peer rank went
    away, the failure is placed on the node of that rank, in the survivor's words, until that node says more.
    Without the map, the node the survivor's records name for that rank (``failed_node``, a node rank) is found
    among the parts by their own node rank."""
    ids = sorted({p.run.run_id for p in parts if p.run is not None})
    failed = [p for p in parts if p.run is not None and p.run.state in ("failed", "vanished", "rebooted")]
    unreachable = [p for p in parts if p.error is not None]
    states = [p.run.state if p.run is not None else None for p in parts if p.error is None]
    out: dict[str, Any] = {
        "run_id": ids[0] if len(ids) == 1 else None,
        "run_ids": ids,
        "nodes": len(parts),
        "running": sum(1 for s in states if s == "running"),
        "failed_node": None,
        "failed_rank": None,
        "cause": None,
        "unreachable": [p.label for p in unreachable],
    }
    if failed:
        root = min(failed, key=lambda p: (_is_peer_echo(p.run.cause if p.run else None), _ended(p)))
        assert root.run is not None
        out.update(state="failed", failed_node=root.label, failed_rank=root.run.failed_rank)
        out["cause"] = f"node {root.label}: {root.run.cause or root.run.state}"
        peer = (rank_nodes or {}).get(root.run.failed_rank) if root.run.failed_rank is not None else None
        if peer is None and root.run.failed_node is not None:
            peer = next((p.label for p in parts if p.run is not None and p.run.node_rank == root.run.failed_node), None)
        if _is_peer_echo(root.run.cause) and peer is not None and peer != root.label:
            out["failed_node"] = peer
            out["cause"] = (
                f"node {peer}: rank {root.run.failed_rank} {PEER_LEFT} (node {root.label} saw it go: {root.run.cause})"
            )
    elif unreachable:
        out["state"] = "unreachable"
        out["cause"] = "; ".join(f"node {p.label} unreachable: {p.error}" for p in unreachable)
    elif not ids or any(s is None for s in states):
        out["state"] = "none" if not ids else "partial"
        missing = [p.label for p in parts if p.run is None]
        if ids and missing:
            out["cause"] = f"no run on {', '.join(missing)}"
    elif all(s == "running" for s in states):
        out["state"] = "running"
    elif any(s in ("starting", "running") for s in states):
        out["state"] = "starting" if all(s in ("starting", "running") for s in states) else "partial"
    elif all(s == "stopped" for s in states):
        out["state"] = "stopped"  # every node's part ended on the stop, cleanly
    else:
        out["state"] = "exited"
    if len(ids) > 1 and out["state"] != "failed":
        out["state"], out["cause"] = "mixed", f"the nodes' current runs differ: {', '.join(ids)}"
    return out


def _ended(part: NodeRun) -> float:
    return part.run.ended_at if part.run is not None and part.run.ended_at is not None else float("inf")


def tag_line(label: str, line: str) -> str:
    """A node's log line as the merged log shows it: ``[node] line``, ``[node/rank R] line`` for a further rank's
    own line (the engine prefixes those ``[rank R] ``)."""
    if line.startswith("[rank "):
        end = line.find("] ")
        if end > 0 and line[6:end].isdigit():
            return f"[{label}/rank {line[6:end]}] {line[end + 2 :]}"
    return f"[{label}] {line}"
