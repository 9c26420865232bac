"""Launching and restarting, composed once for the headless CLI and the dashboard.

A restart is the agent's ``restart`` command: it stops the current run (when it still runs) and launches the
spec that run recorded (command, cwd, env, deadlines, restart policy) under a new run id, in one reply. The
client never rebuilds that spec itself, so the CLI's ``restart`` and the dashboard's ``r`` start the same thing.

The engine's interpreter on the host is chosen here, once, for every launch the client composes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Protocol

from engine import protocol
from tui.link.session import typed_reply

STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL grace of a stop (the agent's own default)
RELEASE_TIMEOUT_S = 30.0  # how long a stop waits for the run's GPU devices to be released
RESTART_REPLY_MARGIN_S = 180.0  # the restart reply may take the grace, the release wait and a launch


class Requester(Protocol):
    """What a restart needs of a session (``tui.link.session.Session`` or a test's stand-in)."""

    async def request(
        self, cmd: str, *, timeout_s: float | None = None, params: dict[str, Any] | None = None, **args: Any
    ) -> dict[str, Any]: ...


class HasHello(Protocol):
    """A session whose agent said hello (its ``opts`` and ``transport``, when it has them, refine the launch)."""

    agent: protocol.HelloEvent | None


def engine_python(explicit: str | None, agent_python: str | None) -> str:
    """The interpreter that runs the engine on the host.

    The user's ``--python`` first (an explicit choice is never overridden by a discovered default), then the
    agent's own interpreter (an absolute path known to run there), then ``python3`` from the run's PATH.
    """
    return explicit or agent_python or "python3"


def launch_spec_for(profile: dict[str, Any] | None, session: HasHello) -> dict[str, Any]:
    """The ``launch`` command's arguments for a profile dict (a LaunchSpec dict, or a Profile.as_dict()).

    Raises ValueError with a sentence when no spec can be made.
    """
    from tui.profiles import EngineConfig, Profile, ProfileError, resolve_profile

    allowed = {f.name for f in fields(protocol.LaunchSpec)}
    if profile is None:
        config = getattr(getattr(session, "opts", None), "config", None)
        name = getattr(getattr(session, "opts", None), "profile", None)
        try:
            profile = resolve_profile(name, config).as_dict()
        except ProfileError as exc:
            raise ValueError(str(exc)) from exc
    if profile.get("command"):
        spec = {k: v for k, v in profile.items() if k in allowed and v is not None}
        if "profile" not in spec and isinstance(profile.get("name"), str):
            spec["profile"] = profile["name"]
        return spec
    engine = profile.get("engine") or {}
    prof = Profile(
        name=str(profile.get("name") or "default"),
        command=None,
        cwd=profile.get("cwd"),
        env=dict(profile.get("env") or {}),
        engine=EngineConfig(**{k: v for k, v in engine.items() if k in ("preset", "config", "args")}),
    )
    if isinstance(profile.get("step_pattern"), str):
        prof.step_pattern = profile["step_pattern"]
    if isinstance(profile.get("deadlines_s"), dict):
        prof.deadlines_s = dict(profile["deadlines_s"])
    if isinstance(profile.get("restart"), dict):
        prof.restart = dict(profile["restart"])
    python_path = session.agent.python_path if session.agent else None
    python = engine_python(getattr(getattr(session, "opts", None), "python", None), python_path)
    pythonpath = getattr(getattr(session, "transport", None), "engine_pythonpath", None)
    spec = protocol.to_jsonable(prof.launch_spec(None, python=python, engine_pythonpath=pythonpath))
    return {k: v for k, v in spec.items() if v is not None}


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


async def restart_run(session: Requester, *, grace_s: float = STOP_GRACE_S) -> Restarted:
    """Stop the current run if it runs, then launch its recorded spec again; raises the session's CommandFailed
    (ReplyNotUnderstood when the reply does not decode)."""
    raw = await session.request(
        "restart",
        timeout_s=grace_s + RELEASE_TIMEOUT_S + RESTART_REPLY_MARGIN_S,
        grace_s=grace_s,
        release_timeout_s=RELEASE_TIMEOUT_S,
    )
    return Restarted(typed_reply(protocol.RestartReply, "restart", raw), dict(raw["launch"]))
