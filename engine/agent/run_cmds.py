"""Agent commands that start, wait for, stop and inspect supervised runs (engine/supervisor).

launch, wait, stop, restart, kill_stale, stacks, serve_check, runs, run_info: argument and result shapes in
engine/protocol/replies.py.
Every command that names no run acts on the current one (<run_root>/current).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine import protocol
from engine.agent.commands import handler, run_dir_arg
from engine.agent.monitor_cmds import monitor_of
from engine.agent.server import Agent, CommandError
from engine.host.holders import NvmlView
from engine.supervisor import kill_stale, launch, records, serve_check, stacks, stop, wait
from engine.supervisor.common import BadRequest, SupervisorError


def _num(args: dict[str, Any], key: str, default: float | None, minimum: float = 0.0) -> float | None:
    value = args.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise CommandError(f"{key} must be a number >= {minimum:g}")
    return float(value)


@contextlib.contextmanager
def _user_errors() -> Iterator[None]:
    """A supervisor's refusal (a sentence for the user) becomes the command's error reply; a bad request's says
    that the request was the problem (``error_kind`` "input")."""
    try:
        yield
    except BadRequest as exc:
        raise CommandError(str(exc), kind=protocol.ERROR_KIND_INPUT) from exc
    except SupervisorError as exc:
        raise CommandError(str(exc)) from exc


@handler("launch")
def _launch(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    with _user_errors():
        res = launch.launch(args, agent.run_root)
    agent.emit(
        protocol.event(
            "milestone", run_id=res["run_id"], milestone="submitted", t=res["submitted_at"], ok=True, cause=None
        )
    )
    return res


@handler("wait")
def _wait(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    milestone = args.get("milestone", "started")
    if milestone not in protocol.MILESTONES:
        raise CommandError(f"unknown milestone {milestone!r}; milestones: {list(protocol.MILESTONES)}")
    rd = run_dir_arg(agent, args)
    deadlines = args.get("deadlines_s")
    if deadlines is not None and not isinstance(deadlines, dict):
        raise CommandError("deadlines_s must map milestones to seconds")

    def on_milestone(name: str, t: float) -> None:
        agent.emit(protocol.event("milestone", run_id=rd.name, milestone=name, t=t, ok=True, cause=None))

    with _user_errors():
        res = wait.wait_for(
            rd,
            milestone,
            _num(args, "timeout_s", None),
            deadlines,
            boot_id=agent.boot_id,
            scanners=agent.scanners,
            on_milestone=on_milestone,
            cancel=agent.stopping,
        )
    if not res.ok:
        agent.emit(protocol.event("milestone", run_id=rd.name, milestone=milestone, t=None, ok=False, cause=res.cause))
    out: dict[str, Any] = protocol.to_jsonable(res)
    return out


def _stop_run(agent: Agent, cmd_id: int | None, args: dict[str, Any], rd: Path) -> dict[str, Any]:
    return stop.stop(
        rd,
        grace_s=_num(args, "grace_s", 30.0) or 0.0,
        release_timeout_s=_num(args, "release_timeout_s", 30.0) or 0.0,
        progress=lambda msg: agent.progress(cmd_id, msg),
        boot_id=agent.boot_id,
        scanners=agent.scanners,
    )


@handler("stop")
def _stop(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    rd = run_dir_arg(agent, args)
    try:
        with _user_errors():
            return _stop_run(agent, cmd_id, args, rd)
    except CommandError as exc:
        going = [] if args.get("run_id") is not None else _runs_still_going(agent, rd)
        if not going:
            raise
        # A later launch made itself current and ended (a trainer refused by the first one's output_dir, say):
        # the run still going is what the user meant to stop, and it is named rather than stopped unasked.
        raise CommandError(f"{exc}; still going here: {', '.join(going)} (stop --run ID stops one)") from exc


def _runs_still_going(agent: Agent, current: Path, most: int = 5) -> list[str]:
    """Ids of the run root's runs other than ``current`` that are starting or running, newest first."""
    going = []
    for rd in reversed(records.unended_runs(agent.run_root)):
        if rd.name == current.name:
            continue
        if records.read_run(rd, agent.boot_id, agent.scanners).state in ("starting", "running"):
            going.append(rd.name)
        if len(going) == most:
            break
    return going


@handler("restart")
def _restart(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """Stop the run if it is running, then launch its recorded spec again under a new run id."""
    rd = run_dir_arg(agent, args)
    with _user_errors():
        spec = launch.spec_of(rd)
        stopped: dict[str, Any] | None = None
        if records.read_run(rd, agent.boot_id, agent.scanners).state in ("running", "starting"):
            stopped = _stop_run(agent, cmd_id, args, rd)
        spec["run_id"] = args.get("new_run_id")
        agent.progress(cmd_id, f"launching {spec.get('command')} again")
        launched = launch.launch(spec, agent.run_root)
    return {"stop": stopped, "launch": launched, "previous_run_id": rd.name}


def _gpu_view(agent: Agent) -> NvmlView:
    """The processes the agent's GPU source sees (NVML, or simulated), for GPU memory and NVML-only holders."""
    mon = monitor_of(agent)
    return mon.gpu_view(mon.gpu_sample(mon.current_run()))


@handler("kill_stale")
def _kill_stale(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    dry_run = args.get("dry_run", True)
    if not isinstance(dry_run, bool):
        raise CommandError("dry_run must be true or false")
    targets = args.get("targets")
    if targets is not None and not isinstance(targets, list):
        raise CommandError("targets must be a list of [pid, create_time] pairs, or null for every listed holder")
    with _user_errors():
        res = kill_stale.kill_stale(
            agent.run_root,
            dry_run=dry_run,
            targets=targets,
            grace_s=_num(args, "grace_s", 10.0) or 0.0,
            progress=lambda msg: agent.progress(cmd_id, msg),
            nvml=_gpu_view(agent),
        )
    out: dict[str, Any] = protocol.to_jsonable(res)
    return out


@handler("stacks")
def _stacks(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    rd = run_dir_arg(agent, args)
    with _user_errors():
        timeout_s = _num(args, "timeout_s", 5.0) or 5.0
        return stacks.stacks(rd, timeout_s=timeout_s, boot_id=agent.boot_id, scanners=agent.scanners)


@handler("serve_check")
def _serve_check(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """Start ``specdec-train serve-check`` on the run's newest checkpoint, detached; its result arrives later as
    the run's ``served`` event."""
    rd = run_dir_arg(agent, args)
    vllm_python = args.get("vllm_python")
    if vllm_python is not None and not isinstance(vllm_python, str):
        raise CommandError("vllm_python must be a string")
    run_live = args.get("run_live", False)
    if not isinstance(run_live, bool):
        raise CommandError("run_live must be true or false")
    with _user_errors():
        return serve_check.start(rd, vllm_python, run_live=run_live)


RUNS_DEFAULT_LIMIT = 20
RUNS_MAX_LIMIT = protocol.RUNS_MAX_LIMIT


@handler("runs")
def _runs(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """The newest ``limit`` runs, newest first, each as its RunInfo plus ``duration_s`` and ``current``."""
    limit = args.get("limit", RUNS_DEFAULT_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 < limit <= RUNS_MAX_LIMIT:
        raise CommandError(f"limit must be an integer 1..{RUNS_MAX_LIMIT}")
    current = records.current_run_dir(agent.run_root)
    dirs = records.list_runs(agent.run_root)
    runs = []
    for rd in reversed(dirs[-limit:]):
        info = records.read_run(rd, agent.boot_id, agent.scanners)
        row = protocol.to_jsonable(info)
        end = info.ended_at if info.ended_at is not None else (time.time() if info.state == "running" else None)
        row["duration_s"] = end - info.started_at if end is not None and info.started_at is not None else None
        row["current"] = current is not None and rd.name == current.name
        runs.append(row)
    return {"runs": runs, "total": len(dirs)}


@handler("run_info")
def _run_info(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """One run (``run_id``, default the current one) as its records and the process table say it is now."""
    rd = run_dir_arg(agent, args)
    return {"run": records.read_run(rd, agent.boot_id, agent.scanners)}
