"""Read-only mode, for watching someone else's run: a profile's ``readonly = true`` (or ``connect --readonly``)
makes every headless verb that would launch, stop, restart or kill exit 2 with one line before anything connects,
and a read-only agent refuses those commands itself, whoever sends them. Watching (status, logs, runs,
``kill-stale --dry-run``) goes on. Real CLI, real agent, real runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.agent import AgentPool, launch_and_wait

from engine.host import procs
from engine.supervisor import records

Cli = Callable[..., Any]
WATCH = "[profiles.watch]\nreadonly = true\n"


@pytest.fixture
def watched(cli: Cli, run_root: Path, tmp_path: Path) -> tuple[Path, str]:
    """A config with a read-only profile, and a run of someone else's that is running."""
    cfg = tmp_path / "config.toml"
    cfg.write_text(WATCH)
    r = cli("launch", "local", "--run-root", str(run_root), "--wait", "started", "--json", "--", "sleep", "300")
    assert r.returncode == 0, r.output
    return cfg, json.loads(r.stdout)["run_id"]


@pytest.mark.parametrize(
    "argv",
    [
        ["launch", "--", "sleep", "1"],
        ["stop"],
        ["stop", "--run", "RUN"],
        ["restart"],
        ["kill-stale", "--yes"],
        ["stacks"],
    ],
    ids=lambda a: " ".join(a),
)
def test_a_read_only_profile_refuses_every_acting_verb_in_one_line_and_touches_nothing(
    cli: Cli, run_root: Path, watched: tuple[Path, str], argv: list[str]
) -> None:
    cfg, run_id = watched
    verb, rest = argv[0], [run_id if a == "RUN" else a for a in argv[1:]]
    try:
        r = cli(verb, "local", "--run-root", str(run_root), "--config", str(cfg), "--profile", "watch", *rest)
        assert r.returncode == 2 and r.stdout == "" and "Traceback" not in r.stderr, r.output
        assert r.stderr.splitlines()[-1] == (
            f"specdec-tui {verb}: error: read-only (profile watch has readonly = true): {verb} is refused; "
            "nothing was done"
        )
        assert [d.name for d in records.runs_dir(run_root).iterdir()] == [run_id]  # nothing launched
        launch = records.read_json(records.run_dir_for(run_root, run_id) / records.LAUNCH_JSON) or {}
        assert procs.process_alive(int(launch.get("job_pid") or launch["pid"]), None)  # nothing stopped
    finally:
        cli("stop", "local", "--run-root", str(run_root), "--run", run_id, "--grace", "2")


def test_a_read_only_profile_still_watches(cli: Cli, run_root: Path, watched: tuple[Path, str]) -> None:
    cfg, run_id = watched
    common = ["local", "--run-root", str(run_root), "--config", str(cfg), "--profile", "watch"]
    try:
        for argv in (["status", "--json"], ["logs", "-n", "5"], ["runs"], ["kill-stale", "--dry-run"]):
            r = cli(argv[0], *common, *argv[1:])
            assert r.returncode == 0, (argv, r.output)
        launched = cli("connect", *common, "--launch")
        assert launched.returncode == 2 and "read-only (profile watch has readonly = true): --launch is refused" in (
            launched.stderr
        ), launched.output
    finally:
        cli("stop", "local", "--run-root", str(run_root), "--run", run_id, "--grace", "2")


def test_a_read_only_agent_refuses_to_act_whoever_asks(pool: AgentPool) -> None:
    worker = pool.make()
    launched, _, _ = launch_and_wait(worker, ["sleep", "300"], "started", 20)
    watcher = pool.make(args=["--readonly"])
    assert watcher.hello["readonly"] is True
    for cmd, args in (
        ("launch", {"command": ["sleep", "1"]}),
        ("stop", {"grace_s": 1}),
        ("restart", {"grace_s": 1}),
        ("kill_stale", {"dry_run": False}),
        ("serve_check", {"run_live": True}),
        ("stacks", {}),
    ):
        reply = watcher.request(cmd, **args)
        assert not reply["ok"] and reply["error"] == (
            f"read-only: this agent never runs {cmd} (connect --readonly, or the profile's readonly = true)"
        ), reply
    assert watcher.ok("kill_stale", dry_run=True)["signalled"] == []
    assert watcher.ok("run_info")["run"]["state"] == "running"
    assert watcher.ok("status")["run"]["run_id"] == launched["run_id"]
    assert [p.name for p in records.runs_dir(pool.root).iterdir()] == [launched["run_id"]]
