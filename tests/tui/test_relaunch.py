"""One interpreter choice for every launch the client composes, and the restart the CLI and the dashboard share."""

from __future__ import annotations

from tui_recorded import RecordingSession

from tui.relaunch import engine_python, restart_run


def test_the_users_python_wins_then_the_agents_own_then_python3() -> None:
    assert engine_python("/opt/venv/bin/python", "/usr/bin/python3.11") == "/opt/venv/bin/python"
    assert engine_python(None, "/usr/bin/python3.11") == "/usr/bin/python3.11"
    assert engine_python(None, None) == "python3"


async def test_restart_is_the_agents_restart_command_and_reads_its_reply() -> None:
    launched = {"run_id": "r2", "run_dir": "/runs/r2", "tmux_session": "specdec-r2", "attachable": True}
    session = RecordingSession(replies={"restart": {"previous_run_id": "r1", "stop": None, "launch": launched}})
    done = await restart_run(session, grace_s=5.0)
    assert session.commands() == ["restart"]
    assert session.requests[0][1] == {"grace_s": 5.0, "release_timeout_s": 30.0}
    assert (done.previous_run_id, done.run_id, done.stop) == ("r1", "r2", None)
