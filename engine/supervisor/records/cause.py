"""Why a run failed, or will never start: the failing rank and its reason, the cause line of a failed run, and what
tmux or the process table says of a wrapper that never wrote launch.json. (What output.log says is in log_failure.)
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass

from engine.host import procs
from engine.supervisor import tmux
from engine.supervisor.records.documents import ExitRecord, SubmittedRecord
from engine.supervisor.records.scanner import RankState, ScanState

_PEER_RE = re.compile(r"peer rank (\d+) \(node (\d+)")
_LISTED_PEER_RE = re.compile(r"rank (\d+) \(node (\d+)")


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def pane_note(launch_sub: SubmittedRecord) -> str | None:
    """Why a wrapper never wrote launch.json, as tmux (or, without tmux, the process table) saw it."""
    session = launch_sub.tmux_session
    if not session:
        pid = launch_sub.launcher_wrapper_pid
        if pid is not None and not procs.process_alive(pid, launch_sub.launcher_wrapper_start_ticks):
            return f"the wrapper (pid {pid}, started with setsid) exited"
        return None
    state = tmux.pane_state(session)
    deadline = time.monotonic() + 2.0
    while state is not None and state["dead"] and state["dead_status"] is None and state["dead_signal"] is None:
        # Dead pty, child not reaped yet (or its SIGCHLD lost by tmux): have the server reap, then read again.
        if time.monotonic() > deadline:
            return f"the tmux pane of session {session} exited (tmux recorded no exit status)"
        tmux.reap_children()
        state = tmux.pane_state(session)
        if state is not None and state["dead"] and state["dead_status"] is None and state["dead_signal"] is None:
            time.sleep(0.05)
    if state is None:
        return f"tmux session {session} is gone"
    if state["dead"]:
        if state["dead_signal"] is not None:
            sig = int(state["dead_signal"])
            return f"the tmux pane of session {session} was killed by signal {sig} ({signal_name(sig)})"
        return f"the tmux pane of session {session} exited with status {state['dead_status']}"
    return None


# How long after submission a run whose launcher is gone may still be taken up by tmux or setsid (tmux's own
# command timeout, with its retries, bounds how long a tmux client of a vanished agent can still create the session).
STARTING_GRACE_S = 15.0


def never_started_cause(sub: SubmittedRecord, now: float | None = None) -> str | None:
    """Why a submitted run that has no launch.json will never start; None while its wrapper may still write one."""
    session = sub.tmux_session
    if sub.phase == "submitting":
        lpid = sub.launcher_pid
        if procs.process_alive(lpid, sub.launcher_start_ticks):
            return None  # the agent is still inside the launch
        if session and tmux.has_session(session):
            return pane_note(sub)  # tmux took it before the agent went
        t = sub.t
        if t is not None and (now if now is not None else time.time()) - t < STARTING_GRACE_S:
            return None
        how = f"tmux accepted session {session}" if session else "it started the wrapper with setsid"
        return f"the agent (pid {lpid}) that launched it exited before {how}"
    return pane_note(sub)


ROOT_CAUSE_KEY = "root_cause"  # exit.json: the wrapper's word on the last attempt's own root cause


def root_cause(scan: ScanState, since: float | None = None) -> str | None:
    """What failed, in the run's own words: the failing rank (torchrun), else the log's root exception or first
    error line (a full disk first), else the first engine thread error (at or after ``since``, the attempt's
    start, when given); None when nothing names it."""
    blamed = rank_failure(scan)
    if blamed is not None:
        return blamed.text
    named = scan.failure.describe()
    if named:
        return named
    errors = [e for e in scan.thread_errors if since is None or e.t is None or e.t >= since]
    if errors:
        first = errors[0]
        return f"engine thread {first.thread}: {first.exc_type}: {first.message}"
    return None


STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL})  # what a stop ends a job with


def stopped_cause(scan: ScanState, exit_code: int | None, signum: int | None, asked: str) -> str | None:
    """The cause line of a job that ended because it was asked to stop (``asked``: the signal the stop sent, e.g.
    SIGTERM), or None when it ended some other way. torchrun exits 1 on a SIGTERM (its agent raises SignalException)
    although every rank stopped cleanly: then each rank of this node must have ended ok, none with its own error. A
    job killed by the stop's signal (or the SIGKILL after its grace) counts as stopped unless its log names a cause."""
    if exit_code == 0 and signum is None:
        return f"stopped ({asked}): exited with code 0"  # it handled the stop's signal and ended cleanly
    if scan.distributed():
        ranks = [r for r in scan.ranks.values() if r.rank is not None]
        expected = max((r.local_world_size or 0 for r in ranks), default=0)
        clean = all(r.run_end is not None and r.run_end.ok and _own_error(r) is None for r in ranks)
        if not ranks or len(ranks) < expected or not clean:
            return None
        how = (
            f"killed by signal {signum} ({signal_name(signum)})"
            if signum is not None
            else f"exited with code {exit_code}"
        )
        return f"stopped ({asked}), torchrun {how}; every rank ended cleanly"
    if signum is None or signum not in STOP_SIGNALS or root_cause(scan) is not None:
        return None
    return f"stopped ({asked}): killed by signal {signum} ({signal_name(signum)})"


def failure_cause(scan: ScanState | None, exit_rec: ExitRecord, last_step: int | None) -> str:
    """A failed run's cause: the root exception (torchrun: the failing rank and its exception), else what the wrapper
    recorded; then how the job ended and its last step. After restarts the wrapper's record of the last attempt's
    own cause wins: the log holds every attempt's words, the first attempt's first."""
    parts: list[str] = []
    recorded = exit_rec.cause
    recorded_root = exit_rec.extra.get(ROOT_CAUSE_KEY)
    recorded_root = recorded_root if isinstance(recorded_root, str) and recorded_root else None
    restarted = (exit_rec.attempts or 1) > 1
    own = root_cause(scan) if scan is not None and not restarted else None
    if restarted and recorded_root is not None:
        parts.append(recorded_root)
    elif own:
        parts.append(own)
    elif recorded_root is not None:
        parts.append(recorded_root)  # e.g. the disk filled before the job could write why
    elif isinstance(recorded, str) and recorded and not recorded.startswith(("exited with code", "killed by signal")):
        parts.append(recorded)  # how the job ended follows, said once
    signum, exit_code = exit_rec.signal, exit_rec.exit_code
    if signum is not None:
        parts.append(f"killed by signal {signum} ({signal_name(signum)})")
    elif exit_code is not None:
        parts.append(f"exit code {exit_code}")
    parts.append(f"last step {last_step}" if last_step is not None else "no step reached")
    return "; ".join(parts)


@dataclass(frozen=True)
class RankFailure:
    text: str  # "rank 1 (node 0) killed by SIGKILL", "rank 1 (node 0): thread drafter0: RuntimeError: boom"
    rank: int | None
    node: int | None


_REASON_CHARS = 400
PEER_FAILURE = "PeerFailure"  # the engine's exception for "a peer rank failed or left": a consequence, not a cause


def _short(text: str) -> str:
    return text if len(text) <= _REASON_CHARS else text[: _REASON_CHARS - 1] + "…"


def _own_error(rs: RankState) -> str | None:
    """What a rank's own events say failed in it (not a peer's failure it only saw)."""
    for err in rs.thread_errors:
        if err.exc_type != PEER_FAILURE:
            return f"thread {err.thread}: {err.exc_type}: {_short(err.message)}"
    end = rs.run_end
    reason = end.reason if end is not None else ""
    if end is not None and not end.ok and PEER_FAILURE not in reason and _peer_in(reason) is None:
        return _short(reason)
    return None


def _peer_in(text: str) -> tuple[int, int] | None:
    """(rank, node) of the peer a PeerFailure message blames: "peer rank 1 (node 1, host pid 7) is gone", or the
    only one listed in "a peer failed or timed out ...; peers: rank 1 (node 1, host)"."""
    m = _PEER_RE.search(text)
    if m is not None:
        return int(m.group(1)), int(m.group(2))
    listed = text.split("; peers: ", 1)[1] if "; peers: " in text else ""
    found = _LISTED_PEER_RE.findall(listed.split(":", 1)[0])
    return (int(found[0][0]), int(found[0][1])) if len(found) == 1 else None


def _blamed_peer(rs: RankState) -> tuple[int, int, str] | None:
    """(peer rank, its node, what this rank said) when this rank ended because a peer failed or went away."""
    texts = [rs.run_end.reason if rs.run_end is not None else ""] + [e.message for e in rs.thread_errors]
    for text in texts:
        peer = _peer_in(text)
        if peer is not None:
            return peer[0], peer[1], text
    return None


def rank_failure(scan: ScanState) -> RankFailure | None:
    """The rank of a torchrun run that failed first and why: torchrun's root cause names the rank (and its signal
    or exit code), the rank's own events say why; a rank that only saw a peer go (the killed node's agent, on
    another host) names that peer. None for a run that is not torchrun's or where no rank failed."""
    if not scan.distributed():
        return None
    f = scan.failure
    if f.root_rank is not None:
        rs = scan.ranks.get(f.root_rank) or RankState(f.root_rank)
        peer = _blamed_peer(rs)
        if peer is not None and _own_error(rs) is None:
            return _peer_failure(rs, peer)
        code = f.root_exitcode
        if code is not None and code < 0:
            return RankFailure(f"{rs.label()} killed by {signal_name(-code)}", rs.rank, rs.node)
        own = _own_error(rs)
        if own is not None:
            return RankFailure(f"{rs.label()}: {own}", rs.rank, rs.node)
        how = f" exited with code {code}" if code is not None else " failed"
        return RankFailure(f"{rs.label()}{how}" + (f": {f.root_detail}" if f.root_detail else ""), rs.rank, rs.node)
    ended = sorted(
        (
            r
            for r in scan.ranks.values()
            if r.rank is not None and (r.thread_errors or (r.run_end is not None and not r.run_end.ok))
        ),
        key=lambda r: r.rank or 0,
    )
    for rs in ended:  # a rank that failed on its own first
        own = _own_error(rs)
        if own is not None:
            return RankFailure(f"{rs.label()}: {own}", rs.rank, rs.node)
    for rs in ended:
        peer = _blamed_peer(rs)
        if peer is not None:
            return _peer_failure(rs, peer)
    return None


def _peer_failure(rs: RankState, peer: tuple[int, int, str]) -> RankFailure:
    rank, node, said = peer
    return RankFailure(
        f"rank {rank} (node {node}) failed or left the run; {rs.label()} said: {_short(said)}", rank, node
    )
