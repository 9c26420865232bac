"""Headless commands that look: status, runs, logs, doctor, stacks."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import sys
import time
from typing import Any

from engine import protocol
from tui import profiles, restarts
from tui.cli.common import (
    EXIT_CONNECTION,
    EXIT_FAILED,
    EXIT_OK,
    UsageError,
    count_arg,
    err,
    positive_float,
    print_json,
    run_id_arg,
    say_link_state,
    simulated_label,
    with_session,
)
from tui.hosttext import TerminalFilter, printable, printable_lines
from tui.link.events import ClientEvent, ConnectionEvent, Undecodable
from tui.link.session import CommandFailed, Session, typed_reply
from tui.timewords import duration, when

# -- status ----------------------------------------------------------------------------------------


def _num(value: Any, fmt: str = "{:.0f}", unit: str = "") -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return fmt.format(value) + unit
    return "-"


def _nvml_unavailable(snap: protocol.StatusReply, agent: protocol.HelloEvent | None) -> str | None:
    """The reason NVML is unavailable, or None when it works (or GPUs are simulated)."""
    if snap.nvml_error:
        return snap.nvml_error
    if snap.simulated or (agent is not None and agent.simulated):
        return None
    cap = agent.capabilities.get("nvml") if agent is not None else None
    if isinstance(cap, dict) and not cap.get("ok"):
        return str(cap.get("detail") or "unknown reason")
    return None


def runs_limit_arg(text: str) -> int:
    """``runs --limit``: 1..RUNS_MAX_LIMIT, checked here so a bad value is a usage error (exit 2), not a failed run."""
    count = count_arg(text)
    if not 0 < count <= protocol.RUNS_MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"expected 1..{protocol.RUNS_MAX_LIMIT} runs, got {count}")
    return count


def _table(rows: list[list[str]], indent: str = "  ") -> list[str]:
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def format_run(run: protocol.RunInfo) -> list[str]:
    """The run block of ``status``: id, state, command, milestones, step/exit, and a failed run's cause."""
    out: list[str] = []
    out.append(f"run       {run.run_id}  state {run.state}  pid {run.pid}")
    if run.command:
        out.append(f"  command {' '.join(run.command)}")
    ms = run.milestones
    reached = [f"{m} ✓" if ms.get(m) else f"{m} ·" for m in protocol.MILESTONES if m in ms]
    if reached:
        out.append("  milestones " + "  ".join(reached))
    extra = []
    if run.stage:
        extra.append(f"stage {run.stage}")
    if run.last_step is not None:
        extra.append(f"step {run.last_step}")
    if run.exit_code is not None:
        extra.append(f"exit code {run.exit_code}")
    if run.signal is not None:
        extra.append(f"signal {run.signal}")
    if run.tmux_session:
        extra.append(f"tmux {run.tmux_session}" + ("" if run.attachable else " (not attachable)"))
    if extra:
        out.append("  " + "   ".join(extra))
    if run.cause:
        out.append(f"  cause {run.cause}")
    said = restarts.summary(run)
    if said:
        out.append(f"  {said}")
        for i, item in enumerate(restarts.restarts_of(run), start=1):
            out.append(f"    {restarts.line(i, item, run.restart_max)}")
    if run.output_dir:
        out.append(f"  output  {run.output_dir}   (specdec-train export takes it)")
    if run.last_export:
        out.append(f"  exported {run.last_export}")
    if run.events_unread_bytes:
        out.append(f"  events  {run.events_unread_bytes / 2**20:.1f} MiB in the middle of its events not read (huge)")
    return [printable(line) for line in out]  # each line is one line, whatever the host's words hold


def format_status(snap: protocol.StatusReply, agent: protocol.HelloEvent | None, target: str) -> str:
    out: list[str] = []
    host = snap.host
    sim = snap.simulated or (agent is not None and agent.simulated)
    hostname = host.hostname or (agent.hostname if agent else None) or "?"
    python = host.python or (agent.python if agent else None)
    out.append(
        f"host      {hostname} via {target}   python {python}   "
        f"agent {agent.agent_version if agent else None}" + ("   [SIMULATED GPUs]" if sim else "")
    )
    gpus = snap.gpus
    reason = _nvml_unavailable(snap, agent)
    if reason and not gpus:
        out.append(f"GPUs      NVML unavailable: {reason}")
    else:
        note = f"   NVML unavailable: {reason}" if reason else ""
        out.append(f"GPUs{' (SIMULATED)' if sim else ''}: {len(gpus)}{note}")
        rows = [["#", "name", "util", "memory used/total", "temp", "power", "holders"]]
        for g in gpus:
            name = (g.name or "?") + (" [sim]" if g.simulated else "")
            mem = f"{_num(g.mem_used_mib)} / {_num(g.mem_total_mib)} MiB"
            holder_pids = ",".join(str(p) for p in g.holder_pids) or "-"
            rows.append(
                [
                    str(g.index),
                    name,
                    _num(g.util_pct, unit="%"),
                    mem,
                    _num(g.temp_c, unit="C"),
                    _num(g.power_w, unit="W"),
                    holder_pids,
                ]
            )
        out += _table(rows)
    tree, holders = snap.processes.run_tree, snap.processes.holders
    out += format_run(snap.run) if snap.run else ["run       none"]
    if tree:
        out.append(f"run processes: {len(tree)}")
        rows = [["pid", "ppid", "user", "cpu", "rss", "threads", "command"]]
        for p in tree[:30]:
            rows.append(
                [
                    str(p.pid),
                    str(p.ppid),
                    p.user or "-",
                    _num(p.cpu_pct, unit="%"),
                    _num(p.rss_mib, unit=" MiB"),
                    str(len(p.threads)),
                    p.cmd[:80],
                ]
            )
        out += _table(rows)
    out.append(f"GPU holders: {len(holders)}")
    if holders:
        rows = [["pid", "user", "gpus", "mem", "state", "in run", "command"]]
        for h in holders:
            rows.append(
                [
                    str(h.pid) + ("" if h.resolved else " (unresolved)"),
                    h.user or "-",
                    ",".join(str(i) for i in h.gpus) or "-",
                    _num(h.used_mib, unit=" MiB"),
                    h.state or "-",
                    "yes" if h.in_run else "no",
                    (h.cmd or "")[:70],
                ]
            )
        out += _table(rows)
    anomalies = snap.anomalies
    out.append(f"anomalies: {len(anomalies) or 'none'}")
    for a in anomalies:
        where = f" gpu {a.gpu}" if a.gpu is not None else ""
        where += f" pid {a.pid}" if a.pid is not None else ""
        out.append(f"  ! {a.kind}{where}: {a.message}")
    return "\n".join(printable(line) for line in out)


async def fetch_status(session: Session, timeout_s: float = 30.0) -> dict[str, Any]:
    """The ``status`` reply as the agent sent it: what ``--json`` prints (the text decodes it, StatusReply)."""
    snap = await session.request("status", timeout_s=timeout_s)
    if session.agent and session.agent.simulated:
        snap.setdefault("simulated", True)
    return snap


async def cmd_status(args: argparse.Namespace) -> int:
    async def body(session: Session) -> int:
        named = await run_named(session, args)
        if named is not None:
            raw, run = named
            if args.json:
                print_json({"run": raw})
            else:
                print("\n".join(format_run(run)), flush=True)
            return EXIT_OK
        snap = await fetch_status(session)
        if args.json:  # printed as sent: --json is for scripts that may know fields this client does not
            print_json(snap)
        else:
            status = typed_reply(protocol.StatusReply, "status", snap)
            print(format_status(status, session.agent, session.target_display), flush=True)
        return EXIT_OK

    return await with_session(args, body)


# -- runs ------------------------------------------------------------------------------------------


def format_runs(runs: list[protocol.ListedRun], total: int) -> str:
    rows = [["id", "state", "started", "duration", "last step", "exit", "output", "cause"]]
    for r in runs:
        exit_txt = str(r.exit_code) if r.exit_code is not None else "-"
        if r.signal is not None:
            exit_txt = f"signal {r.signal}"
        rows.append(
            [
                r.run_id + (" *" if r.current else ""),
                r.state,
                when(r.started_at),
                duration(r.duration_s),
                str(r.last_step) if r.last_step is not None else "-",
                exit_txt,
                r.output_dir or "-",
                (r.cause or "")[:100],
            ]
        )
    more = f"   ({total - len(runs)} older: --limit)" if total > len(runs) else ""
    lines = [*_table(rows, indent=""), f"{len(runs)} of {total} runs, newest first; * current{more}"]
    return "\n".join(printable(line) for line in lines)


async def cmd_runs(args: argparse.Namespace) -> int:
    async def body(session: Session) -> int:
        res = await session.request("runs", timeout_s=60.0, limit=args.limit)
        if args.json:  # printed as sent, as status --json
            print_json(res)
            return EXIT_OK
        listed = typed_reply(protocol.RunsReply, "runs", res)
        if not listed.runs:
            print("no runs yet", flush=True)
        else:
            print(format_runs(listed.runs, listed.total or len(listed.runs)), flush=True)
        return EXIT_OK

    return await with_session(args, body)


# -- logs ------------------------------------------------------------------------------------------


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd``, waiting while the reader is behind. Also when ``fd`` is non-blocking
    (O_NONBLOCK is shared by every process holding that pipe end): a full pipe then raises EAGAIN, which must mean
    "wait", never "skip". BrokenPipeError (the reader is gone) propagates."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            select.select([], [fd], [])


def _reader_gone() -> int:
    """stdout's reader closed the pipe (``| head``): stop quietly, as a filter does."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush must not fail again
    os.close(devnull)
    return EXIT_FAILED


class LogOutput:
    """Where ``logs`` writes the log's bytes: to a pipe or a file exactly as they are; to a terminal through
    TerminalFilter (colour shown, every other control sequence made visible) unless ``--raw``."""

    def __init__(self, fd: int, *, raw: bool) -> None:
        self.fd = fd
        self.filter = None if raw or not os.isatty(fd) else TerminalFilter()

    def write(self, data: bytes) -> None:
        write_all(self.fd, data if self.filter is None else self.filter.feed(data))

    def flush(self, *, final: bool) -> None:
        """``final``: nothing more comes, so a held back unfinished sequence is written (neutralised) too."""
        if self.filter is not None and final:
            write_all(self.fd, self.filter.flush())


TAIL_IN_REPLY_MAX_LINES = 10_000  # the agent's cap on lines in one tail reply; more are read as byte chunks
READ_CHUNK_BYTES = 1024 * 1024


def _run_params(args: argparse.Namespace) -> dict[str, Any]:
    return {"run_id": args.run} if getattr(args, "run", None) else {}


async def run_named(session: Session, args: argparse.Namespace) -> tuple[Any, protocol.RunInfo] | None:
    """The RunInfo of ``--run ID`` as sent (for ``--json``) and decoded (None without --run); an ID the host does
    not have is a usage error (exit 2), a reply that does not decode a failed command (exit 1)."""
    if not getattr(args, "run", None):
        return None
    try:
        reply = await session.request("run_info", timeout_s=30.0, run_id=args.run)
    except CommandFailed as exc:
        if exc.lost:
            raise
        raise UsageError(f"--run {args.run}: {exc.message} (`specdec-tui runs TARGET` lists them)") from None
    return reply.get("run"), typed_reply(protocol.RunInfoReply, "run_info", reply).run


async def _print_last_lines(session: Session, args: argparse.Namespace, out: LogOutput) -> protocol.TailReply:
    """Print the last ``args.lines`` lines of the run's output.log, however many; returns the tail reply, whose
    ``offset``/``inode`` say where the printed bytes end. BrokenPipeError when stdout's reader left."""
    n = int(args.lines)
    tail = None
    if n <= TAIL_IN_REPLY_MAX_LINES:
        tail = await session.ask(protocol.TailReply, "tail", timeout_s=30.0, n=n, **_run_params(args))
    if tail is not None and not tail.window_cut:  # else long lines overran the reply's byte window
        lines = tail.lines
        for i, line in enumerate(lines):
            data = protocol.decode_log_data(line)
            last_partial = i == len(lines) - 1 and tail.partial and args.follow
            out.write(data if last_partial else data + b"\n")  # a follower continues a partial last line
        out.flush(final=not args.follow)
        return tail
    tail = await session.ask(protocol.TailReply, "tail", timeout_s=30.0, n=n, stream=True, **_run_params(args))
    pos, end, inode = tail.start or 0, tail.offset, tail.inode
    run_id = tail.run_id
    last = b"\n"
    while pos < end:
        chunk = await session.ask(
            protocol.ReadLogReply,
            "read_log",
            timeout_s=60.0,
            run_id=run_id,
            offset=pos,
            max_bytes=min(READ_CHUNK_BYTES, end - pos),
        )
        data = chunk.raw
        if chunk.inode != inode or not data:
            raise CommandFailed(f"output.log of run {run_id} was replaced or truncated while read (at byte {pos})")
        data = data[: end - pos]
        out.write(data)
        pos += len(data)
        last = data[-1:]
    if last != b"\n" and not args.follow:
        out.write(b"\n")
    out.flush(final=not args.follow)
    return tail


RUN_OVER = frozenset({"exited", "failed", "stopped", "vanished", "rebooted"})  # run states with no more output
LOG_QUIET_S = 1.5  # after a run's end, this long without a log event: its output is all here


async def cmd_logs(args: argparse.Namespace) -> int:
    async def body(session: Session) -> int:
        out = LogOutput(sys.stdout.fileno(), raw=args.raw)
        ended = asyncio.Event()
        reader_gone = False
        followed: str | None = None  # the run whose log is followed, once the tail names it
        run_over: str | None = None  # its end as a run event said it (exited, failed, ...)
        last_log = time.monotonic()

        def on_event(ev: ClientEvent) -> None:
            nonlocal reader_gone, run_over, last_log
            if isinstance(ev, protocol.LogEvent) and not reader_gone:
                last_log = time.monotonic()
                # Written whole before the next event is read: the session's resume offset (bytes received) is
                # then always the bytes on stdout, and a slow reader slows the stream down (TCP back-pressure).
                try:
                    out.write(ev.raw)
                except BrokenPipeError:
                    reader_gone = True
                    ended.set()
            elif isinstance(ev, protocol.RunEvent) and ev.run is not None and ev.run.run_id == followed:
                if ev.run.state in RUN_OVER and run_over is None:
                    run_over = ev.run.state
            elif isinstance(ev, protocol.LogResetEvent):
                err(f"[log {ev.reason}: following from byte {ev.offset}]")
            elif isinstance(ev, Undecodable) and ev.ev in ("log", "log_reset"):  # only what this command prints
                err(f"[{ev.message}]")
            elif isinstance(ev, ConnectionEvent):
                say_link_state(ev)
                if ev.state == "failed":
                    ended.set()

        # Before the first request: a drop while the last lines are asked for is said and retried like any other.
        if args.follow:
            session.add_event_listener(on_event)
        await run_named(session, args)
        sys.stdout.flush()  # the log goes straight to the descriptor, below any buffer
        try:
            tail = await _print_last_lines(session, args, out)
        except BrokenPipeError:
            return _reader_gone()
        if not args.follow:
            return EXIT_OK
        if not tail.current:
            err(f"[run {tail.run_id} is not the current run: it has nothing more to follow]")
            return EXIT_OK
        followed = tail.run_id
        session.resume_from({"offset": tail.offset, "inode": tail.inode} if tail.inode is not None else None, None)
        await session.start_streams(gpu_interval_s=5.0, procs_interval_s=5.0)
        # As `docker logs -f` and `kubectl logs -f` do: once the run has ended and its last bytes came (nothing for
        # LOG_QUIET_S after the end was seen), there is nothing more to follow.
        while not ended.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), timeout=0.25)
            if run_over is not None and not ended.is_set() and time.monotonic() - last_log >= LOG_QUIET_S:
                out.flush(final=True)
                err(f"[run {followed} {run_over}: nothing more to follow]")
                return EXIT_OK
        return _reader_gone() if reader_gone else EXIT_CONNECTION

    return await with_session(args, body, reconnect=args.follow)


# -- doctor ----------------------------------------------------------------------------------------


def _print_check(ok: bool, name: str, detail: str, fix: str | None, level: str = "error") -> None:
    label = "PASS" if ok else ("WARN" if level == "warn" else "FAIL")
    print(printable(f"{label}  {name:<14} {detail}"), flush=True)
    if not ok and fix:
        for line in str(fix).splitlines():
            print(f"      fix: {printable(line)}")


def expects_gpu(args: argparse.Namespace) -> bool:
    """--expect-gpu, or a --profile whose command, environment or engine names CUDA (or a GPU preset)."""
    if args.expect_gpu:
        return True
    if not args.profile:
        return False
    try:
        prof = profiles.resolve_profile(args.profile, args.config)
    except profiles.ProfileError as exc:
        raise UsageError(str(exc)) from None
    preset = prof.engine.preset or ""
    named = "cuda" in json.dumps(prof.as_dict()).lower()
    return named or (prof.command is None and not prof.engine.config and not preset.startswith("cpu"))


async def cmd_doctor(args: argparse.Namespace) -> int:
    from tui.cli.common import connect_options
    from tui.link.session import ConnectError, open_session

    session = open_session(args.target, connect_options(args))
    t0 = time.perf_counter()
    try:
        await session.connect()
    except ConnectError as exc:
        _print_check(False, "connection", exc.message.splitlines()[0], "\n".join(exc.message.splitlines()[1:]) or None)
        return exc.exit_code
    session.auto_reconnect = False
    try:
        hello = session.agent
        via = "local" if session.target_display.startswith("local") else "ssh"
        version, hostname, python = (hello.agent_version, hello.hostname, hello.python) if hello else (None,) * 3
        _print_check(
            True,
            "connection" if via == "local" else "ssh",
            f"{via} to {session.target_display} in {time.perf_counter() - t0:.2f} s; agent {version}"
            f" on {hostname}, python {python}{simulated_label(session)}",
            None,
        )
        result = await session.ask(protocol.DoctorReply, "doctor", timeout_s=120.0, expect_gpu=expects_gpu(args))
    except CommandFailed as exc:
        err(f"error: {exc.message}")
        return EXIT_CONNECTION if exc.lost else EXIT_FAILED
    finally:
        await session.close()
    checks = result.checks
    for c in checks:
        _print_check(c.ok, c.name, c.detail, c.fix, c.level or "error")
    failed = [c for c in checks if not c.ok and c.level != "warn"]
    warned = [c for c in checks if not c.ok and c.level == "warn"]
    passed = len(checks) + 1 - len(failed) - len(warned)
    print(f"{passed} passed, {len(warned)} warnings, {len(failed)} failed", flush=True)
    return EXIT_OK if not failed else EXIT_FAILED


# -- stacks ----------------------------------------------------------------------------------------


async def cmd_stacks(args: argparse.Namespace) -> int:
    async def body(session: Session) -> int:
        await run_named(session, args)
        params = {"timeout_s": args.timeout, **_run_params(args)}
        result = await session.ask(protocol.StacksReply, "stacks", timeout_s=args.timeout + 15.0, params=params)
        print(printable(f"# stacks via {result.method}"), flush=True)
        print(printable_lines(result.text.rstrip()), flush=True)
        return EXIT_OK

    return await with_session(args, body)


def add_parsers(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser("status", parents=[common], help="one snapshot: GPUs, processes, run, anomalies")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--run", type=run_id_arg, metavar="ID", help="only that run (see `runs`), past or current")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("runs", parents=[common], help="past and current runs: state, cause, duration, last step")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--limit", type=runs_limit_arg, default=20, metavar="N", help="the newest N runs (default 20)")
    p.set_defaults(func=cmd_runs)

    p = sub.add_parser("logs", parents=[common], help="the current run's output.log")
    p.add_argument("-f", "--follow", action="store_true", help="keep following (resumes across reconnects)")
    p.add_argument(
        "--raw",
        action="store_true",
        help="to a terminal too, the bytes as they are (by default a terminal gets colour, other escapes made visible)",
    )
    p.add_argument("-n", "--lines", type=count_arg, default=20, metavar="N", help="last N lines first (default 20)")
    p.add_argument("--run", type=run_id_arg, metavar="ID", help="a past run's log (see `runs`); default: current")
    p.set_defaults(func=cmd_logs)

    p = sub.add_parser("doctor", parents=[common], help="check ssh, python, torch, CUDA, NVML, tmux, disk, holders")
    p.add_argument(
        "--expect-gpu",
        action="store_true",
        help="fail when CUDA or NVML is missing (without it, or a profile naming CUDA, a CPU box says 'not present')",
    )
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("stacks", parents=[common], help="every thread's stack of the live run")
    p.add_argument("--timeout", type=positive_float, default=10.0, metavar="S", help="how long to wait for the dump")
    p.add_argument("--run", type=run_id_arg, metavar="ID", help="that run (must be live); default: current")
    p.set_defaults(func=cmd_stacks)


__all__ = ["EXIT_FAILED", "add_parsers", "format_status"]
