"""The read-only dashboard (``connect --readonly``, a profile's ``readonly = true``), for watching someone else's
run: it says READ-ONLY first in its header, offers no launch, and each acting key (launch, restart, stop, kill
stale, serve-check) only shows a notice; its agent refuses those commands too, and attach gives a read-only tmux
client. A real run on a real local agent; the nodes dashboard the same over two local nodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.pilot import wait_until

from engine.host import procs
from engine.supervisor import records
from tui.dashboard.app import DashboardApp
from tui.link.session import CommandFailed, ConnectOptions, open_session

REPO = Path(__file__).resolve().parents[2]
ACTING_KEYS = {"l": "launch", "r": "restart", "s": "stop", "k": "kill stale", "v": "serve-check", "d": "stack dumps"}


@pytest.fixture
def someone_elses_run(run_root: Path, cleanup_runs: list[dict[str, Any]]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "tui", "launch", "local", "--run-root", str(run_root), "--wait", "started", "--json",
         "--", "sleep", "300"],
        capture_output=True, text=True, timeout=60, env=env, cwd=str(REPO), check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    run_id = json.loads(done.stdout)["run_id"]
    run_dir = records.run_dir_for(run_root, run_id)
    tmux_session = (records.read_json(run_dir / records.LAUNCH_JSON) or {}).get("tmux_session")
    cleanup_runs.append({"run_dir": str(run_dir), "tmux_session": tmux_session})
    return {"run_id": run_id, "run_dir": run_dir}


def job_alive(run_dir: Path) -> bool:
    launch = records.read_json(run_dir / records.LAUNCH_JSON) or {}
    return procs.process_alive(int(launch.get("job_pid") or launch["pid"]), None)


def notices(app: Any, words: str) -> list[str]:
    return [n.message for n in app._notifications if words in n.message]


async def test_the_read_only_dashboard_says_so_first_and_no_key_acts_on_the_run(
    run_root: Path, someone_elses_run: dict[str, Any]
) -> None:
    session = open_session("local", ConnectOptions(run_root=str(run_root), python=sys.executable, readonly=True))
    attached: list[list[str]] = []
    app = DashboardApp(session, on_connect="offer", external_runner=lambda argv: attached.append(argv) or 0)
    try:
        async with app.run_test(size=(140, 40)) as pilot:
            await wait_until(pilot, lambda: app.state.run and app.state.run.state == "running", 20, "the run shown")
            header = str(getattr(app.query_one("#header").render(), "plain", ""))
            assert header.startswith("specdec  READ-ONLY  local"), header
            for key, what in ACTING_KEYS.items():
                await pilot.press(key)
                await wait_until(pilot, lambda what=what: notices(app, f"read-only: {what} is off"), 5, what)
                assert len(app.screen_stack) == 1, f"{key} opened {app.screen_stack[-1]}"  # no confirmation asked
            assert job_alive(someone_elses_run["run_dir"])
            assert [d.name for d in records.runs_dir(run_root).iterdir()] == [someone_elses_run["run_id"]]
            assert session.agent is not None and session.agent.readonly is True
            with pytest.raises(CommandFailed, match="read-only: this agent never runs stop"):
                await session.request("stop", timeout_s=10, grace_s=1)  # the agent refuses, whatever the client
            assert job_alive(someone_elses_run["run_dir"])

            await pilot.press("a")  # watching its tmux: a read-only client
            await wait_until(pilot, lambda: app.run_control.attach_history, 5, "the attach")
            argv = app.run_control.attach_history[-1]
            assert argv[argv.index("attach-session") : argv.index("attach-session") + 2] == ["attach-session", "-r"]
            await pilot.press("q")
    finally:
        await session.close()


async def test_the_read_only_nodes_dashboard_says_so_and_no_key_acts_on_any_node(
    run_root: Path, someone_elses_run: dict[str, Any]
) -> None:
    from tui.dashboard.nodes_app import NodesApp
    from tui.dashboard.widgets.text_line import TextLine
    from tui.nodes import resolve_nodes
    from tui.profiles import Profile

    base = ConnectOptions(run_root=str(run_root), python=sys.executable, readonly=True)
    nodes = resolve_nodes(["local", "local"], Profile(name="two"), base)
    app = NodesApp(nodes, flush_interval_s=0.05)
    async with app.run_test(size=(160, 50)) as pilot:
        await wait_until(pilot, lambda: all(n.session and n.session.state == "connected" for n in nodes), 30)
        line = app.screen_of_nodes.query_one("#run-line", TextLine)
        await wait_until(pilot, lambda: line.text.plain.startswith(" specdec · READ-ONLY · 2 nodes"), 5, "the line")
        for key, what in {"l": "launch", "r": "restart", "s": "stop", "k": "kill stale", "d": "stack dumps"}.items():
            await pilot.press(key)
            await wait_until(pilot, lambda what=what: notices(app, f"read-only: {what} is off"), 5, what)
            assert len(app.screen_stack) == 1, f"{key} opened {app.screen_stack[-1]}"
        assert job_alive(someone_elses_run["run_dir"])
        await pilot.press("q")


def test_connect_readonly_reaches_the_session_and_a_profile_can_say_it(tmp_path: Path) -> None:
    from tui.__main__ import build_parser, check_readonly
    from tui.cli.common import connect_options

    cfg = tmp_path / "config.toml"
    cfg.write_text("[profiles.watch]\nreadonly = true\n[profiles.work]\n")
    for argv, expected in (
        (["connect", "local", "--readonly", "--config", str(cfg), "--profile", "work"], True),
        (["connect", "local", "--config", str(cfg), "--profile", "watch"], True),
        (["connect", "local", "--config", str(cfg), "--profile", "work"], False),
    ):
        args = build_parser().parse_args(argv)
        args.target = "local"
        check_readonly(args)
        assert connect_options(args).readonly is expected, argv
