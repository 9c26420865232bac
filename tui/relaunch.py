"""Launching and restarting, composed once for the headless CLI and the dashboard.

A restart is the agent's ``restart`` command: it stops the current run (when it still runs) and launches the
spec that run recorded (command, cwd, env, deadlines, restart policy) under a new run id, in one reply. The
client never rebuilds that spec itself, so the CLI's ``restart`` and the dashboard's ``r`` start the same thing.

The engine's interpreter on the host is chosen here, once, for every launch the client composes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine import protocol
from tui.link.session import AgentSession, typed_reply
from tui.profiles import Profile, resolve_profile

STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL grace of a stop (the agent's own default)
RELEASE_TIMEOUT_S = 30.0  # how long a stop waits for the run's GPU devices to be released
RESTART_REPLY_MARGIN_S = 180.0  # the restart reply may take the grace, the release wait and a launch


def engine_python(explicit: str | None, agent_python: str | None) -> str:
    """The interpreter that runs the engine on the host.

    The user's ``--python`` first (an explicit choice is never overridden by a discovered default), then the
    agent's own interpreter (an absolute path known to run there), then ``python3`` from the run's PATH.
    """
    return explicit or agent_python or "python3"


def session_profile(session: AgentSession) -> Profile:
    """The profile the command line named (``--profile`` in ``--config``), for a launch that was given none;
    raises ProfileError."""
    return resolve_profile(session.opts.profile, session.opts.config)


def launch_spec(
    profile: Profile, session: AgentSession, *, command: list[str] | None = None, cwd: str | None = None
) -> protocol.LaunchSpec:
    """The ``launch`` command's spec: ``profile`` (``command`` from ``-- COMMAND`` replacing its own) started on
    this session's host, by the interpreter and PYTHONPATH the engine has there; ``cwd`` overrides the profile's.

    Every launch the client sends is composed here: the CLI's ``launch`` and ``restart --profile``, the
    dashboard's ``l`` and its offer on connect.
    """
    python = engine_python(session.opts.python, session.agent.python_path if session.agent else None)
    spec = profile.launch_spec(command, python=python, engine_pythonpath=session.engine_pythonpath)
    if cwd is not None:
        spec.cwd = cwd
    return spec


@dataclass
class Restarted:
    """The agent's ``restart`` reply, decoded, with its ``launch`` part also as sent (``restart --json`` prints
    the keys the agent sent, as ``launch --json`` does)."""

    reply: protocol.RestartReply
    launch: dict[str, Any]  # the ``launch`` reply of the new run: run_id, run_dir, tmux_session, attachable

    @property
    def previous_run_id(self) -> str:
        return self.reply.previous_run_id

    @property
    def run_id(self) -> str:
        return self.reply.launch.run_id

    @property
    def stop(self) -> protocol.StopReply | None:
        """The ``stop`` reply, None when the run had already ended."""
        return self.reply.stop


async def restart_run(session: AgentSession, *, grace_s: float = STOP_GRACE_S, run_id: str | None = None) -> Restarted:
    """Stop run ``run_id`` (None: the current run) if it runs, then launch its recorded spec again; raises the
    session's CommandFailed (ReplyNotUnderstood when the reply does not decode)."""
    which: dict[str, Any] = {"run_id": run_id} if run_id is not None else {}
    raw = await session.request(
        "restart",
        timeout_s=grace_s + RELEASE_TIMEOUT_S + RESTART_REPLY_MARGIN_S,
        grace_s=grace_s,
        release_timeout_s=RELEASE_TIMEOUT_S,
        **which,
    )
    return Restarted(typed_reply(protocol.RestartReply, "restart", raw), dict(raw["launch"]))
