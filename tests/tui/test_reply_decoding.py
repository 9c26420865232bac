"""Command replies are decoded once, where they arrive, into engine.protocol's dataclasses: a reply that does not
fit says which field is wrong, and the CLI and the dashboard show that as a failed command, never a crash."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from support.pilot import wait_until
from tui_recorded import RecordingSession, run

from engine import protocol
from tui.__main__ import main
from tui.cli import common as cli_common
from tui.dashboard.app import DashboardApp
from tui.dashboard.screens.runs import RunsScreen
from tui.link.session import CommandFailed, ReplyNotUnderstood, typed_reply

STATUS = {
    "t": 1.0,
    "host": {"hostname": "gpu-box", "python": "3.11.7", "agent_pid": 7, "loadavg": [0.5, 0.25, 0]},
    "gpus": [
        {
            "index": 0,
            "name": "H200",
            "uuid": "GPU-0",
            "util_pct": 97,
            "mem_used_mib": 1000,
            "mem_total_mib": 143771,
            "holder_pids": [5001],
        }
    ],
    "processes": {"run_tree": [], "holders": [{"pid": 5001, "resolved": True, "gpus": [0], "in_run": True}]},
    "run": run()["run"],
    "anomalies": [{"kind": "stale_holder", "message": "pid 9 holds GPU 0", "gpu": 0, "pid": 9}],
    "holders_source": {"source": "nvml", "detail": "NVML's lists"},
    "host_map": None,
    "future_field": {"ignored": True},  # a newer agent's key: ignored, never an error
}


def test_a_status_reply_decodes_into_typed_fields() -> None:
    status = typed_reply(protocol.StatusReply, "status", STATUS)
    assert status.host.hostname == "gpu-box" and status.host.loadavg == [0.5, 0.25, 0.0]
    assert status.gpus[0].util_pct == 97.0 and status.processes.holders[0].in_run
    assert status.run is not None and status.run.state == "running"
    assert status.anomalies[0].kind == "stale_holder" and status.holders_source is not None


BAD_REPLIES: list[tuple[type[Any], str, dict[str, Any], str]] = [
    (protocol.StatusReply, "status", {**STATUS, "processes": None}, "status.processes: expected an object, got null"),
    (protocol.StatusReply, "status", {k: v for k, v in STATUS.items() if k != "run"}, "status: no 'run'"),
    (
        protocol.RunsReply,
        "runs",
        {"runs": [{"run_id": "r1", "run_dir": "/r", "state": 3}], "total": 1},
        "runs.runs[0].state: expected a string, got int",
    ),
    (
        protocol.TailReply,
        "tail",
        {"lines": ["x"], "offset": "12", "run_id": "r1"},
        "tail.offset: expected an integer, got str",
    ),
    (
        protocol.KillStaleReply,
        "kill_stale",
        {"candidates": [{"pid": "9", "resolved": True}]},
        "kill_stale.candidates[0].pid: expected an integer",
    ),
    (protocol.StacksReply, "stacks", {"text": "..."}, "stacks: no 'method'"),
    (protocol.RestartReply, "restart", {"previous_run_id": "r1", "launch": {}}, "restart.launch: no 'run_id'"),
]


@pytest.mark.parametrize(("reply", "cmd", "result", "reason"), BAD_REPLIES)
def test_a_reply_that_does_not_fit_names_the_field(
    reply: type[Any], cmd: str, result: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ReplyNotUnderstood) as caught:
        typed_reply(reply, cmd, result)
    assert isinstance(caught.value, CommandFailed) and not caught.value.lost  # a failed command, not a lost link
    assert reason in caught.value.message, caught.value.message


def _cli_against(monkeypatch: pytest.MonkeyPatch, replies: dict[str, Any]) -> None:
    monkeypatch.setattr(cli_common, "open_session", lambda target, opts: RecordingSession(replies=replies))


def test_status_json_prints_the_agents_object_and_the_text_reads_the_decoded_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_against(monkeypatch, {"status": STATUS})
    assert main(["status", "local", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == STATUS  # unknown keys and integer numbers as the agent sent them
    assert main(["status", "local"]) == 0
    text = capsys.readouterr().out
    assert "host      gpu-box via" in text and "  0  H200  97%   1000 / 143771 MiB" in text
    assert "  ! stale_holder gpu 0 pid 9: pid 9 holds GPU 0" in text


def test_a_status_reply_that_does_not_decode_is_a_failed_command_in_the_cli(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _cli_against(monkeypatch, {"status": {**STATUS, "gpus": [{"index": "zero"}]}})
    assert main(["status", "local"]) == cli_common.EXIT_FAILED
    out, errors = capsys.readouterr()
    assert out == "" and "error: status: the agent's reply is not understood: status.gpus[0].index" in errors
    assert "Traceback" not in errors


def test_status_json_prints_what_the_agent_sent_even_when_this_client_cannot_read_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    odd = {**STATUS, "gpus": [{"index": "zero"}]}  # e.g. a newer agent: scripts reading --json decide for themselves
    _cli_against(monkeypatch, {"status": odd})
    assert main(["status", "local", "--json"]) == cli_common.EXIT_OK
    assert json.loads(capsys.readouterr().out)["gpus"] == [{"index": "zero"}]


async def test_the_dashboard_shows_a_runs_reply_that_does_not_decode_as_an_error_and_opens_no_screen(
    recorded_app: Callable[..., DashboardApp],
) -> None:
    session = RecordingSession(replies={"runs": {"runs": [{"run_id": "r1"}], "total": 1}})
    app = recorded_app(session)

    def errors() -> list[str]:
        return [str(n.message) for n in app._notifications if n.severity == "error"]

    async with app.run_test() as pilot:
        await pilot.press("p")
        await wait_until(pilot, errors, what="the runs reply, on screen")
        assert len(errors()) == 1 and errors()[0].startswith("runs failed:")
        assert "runs.runs[0]: no 'run_dir'" in errors()[0]
        assert not isinstance(app.screen, RunsScreen)
