"""`launch --cwd DIR`, and where a relative script is looked up without it: beside the user for `local`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.agent import checkout_env
from support.waiting import wait_until

from engine.supervisor import records

SCRIPT = "import os\nprint('ran in', os.getcwd(), flush=True)\n"


def _launch(where: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "tui", "launch", *args, "--wait", "output", "--json", "--", sys.executable, "train.py"],
        cwd=str(where), env=checkout_env(), capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    return done, json.loads(done.stdout) if done.stdout.startswith("{") else {}


def _tmux_jobs_running() -> list[int]:
    """Children of the private tmux server that are not its panes' processes (its #() and run-shell jobs)."""

    def ask(fmt: str, *args: str) -> str:
        argv = ["tmux", "-L", os.environ["SPECDEC_TMUX_SOCKET"], *args, fmt]
        return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True).stdout

    server = int(ask("#{pid}", "display-message", "-p"))
    panes = {int(p) for p in ask("#{pane_pid}", "list-panes", "-a", "-F").split()}
    jobs = []
    for entry in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text() if entry.isdigit() else ""
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split() if stat else []
        if fields and int(fields[1]) == server and int(entry) not in panes and fields[0] != "Z":
            jobs.append(int(entry))
    return jobs


def _output(run_root: Path, run_id: str) -> str:
    log = records.run_dir_for(run_root, run_id) / records.OUTPUT_LOG
    wait_until(lambda: "ran in" in log.read_text(), 10, "the job's line 'ran in'", observe=log.read_text)
    return log.read_text()


def test_local_launch_of_a_relative_script_runs_it_in_the_directory_it_was_typed_in(
    run_root: Path, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(SCRIPT)
    done, res = _launch(work, "local", "--run-root", str(run_root))
    assert done.returncode == 0 and res["ok"] is True, done.stdout + done.stderr
    assert f"ran in {work}" in _output(run_root, res["run_id"])


def test_launch_cwd_names_the_jobs_directory_relative_to_where_it_was_typed(run_root: Path, tmp_path: Path) -> None:
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "train.py").write_text(SCRIPT)
    done, res = _launch(tmp_path, "local", "--run-root", str(run_root), "--cwd", "proj")
    assert done.returncode == 0 and res["ok"] is True, done.stdout + done.stderr
    assert f"ran in {tmp_path / 'proj'}" in _output(run_root, res["run_id"])
    # A directory that is not there is bad input, not a failed run: exit 2, as for the client's own bad arguments.
    missing, res = _launch(tmp_path, "local", "--run-root", str(run_root), "--cwd", "nowhere")
    assert missing.returncode == 2 and f"{tmp_path / 'nowhere'} does not exist" in res["cause"], missing.stdout
    assert res["cause"].startswith("launch refused: ") and res["ok"] is False


@pytest.mark.ssh
def test_launch_cwd_reaches_a_remote_host(sshd: Any, run_root: Path, tmp_path: Path) -> None:
    (tmp_path / "remote-proj").mkdir()
    (tmp_path / "remote-proj" / "train.py").write_text(SCRIPT)
    args = [sshd.target, *sshd.args(), "--run-root", str(run_root), "--cwd", str(tmp_path / "remote-proj")]
    done, res = _launch(tmp_path, *args)
    assert done.returncode == 0 and res["ok"] is True, done.stdout + done.stderr
    assert f"ran in {tmp_path / 'remote-proj'}" in _output(run_root, res["run_id"])
    # The remote agent's refusal says the request was wrong: exit 2 across the wire too.
    args = [sshd.target, *sshd.args(), "--run-root", str(run_root), "--cwd", str(tmp_path / "not-there")]
    missing, res = _launch(tmp_path, *args)
    assert missing.returncode == 2 and "not-there does not exist on the host" in res["cause"], missing.stdout


@pytest.mark.parametrize("name", ["#(touch M)", "ends-in;", "#{pane_pid}#[fg=red]"])
def test_a_directory_named_like_a_tmux_format_or_separator_is_only_a_directory(
    run_root: Path, tmp_path: Path, name: str
) -> None:
    """tmux expands ``new-session -c DIR`` as a format (``#(touch M)`` runs touch) and splits an argument ending in
    ';': the job still runs in that directory, and nothing is run on the way."""
    work = tmp_path / "parent" / name
    work.mkdir(parents=True)
    (work / "train.py").write_text(SCRIPT)
    done, res = _launch(work, "local", "--run-root", str(run_root))
    assert done.returncode == 0 and res["ok"] is True, done.stdout + done.stderr
    assert f"ran in {work}" in _output(run_root, res["run_id"])
    # tmux forks a #() job while it handles the command, and reaps it later: once the server has no child but its
    # panes, every job the launch could have started has finished.
    wait_until(lambda: not _tmux_jobs_running(), 10, "the tmux server's background jobs to finish")
    for where in (work, work.parent, tmp_path, Path.cwd(), Path.home(), Path("/")):
        assert not (where / "M").exists(), f"a tmux format ran: {where / 'M'} exists"
