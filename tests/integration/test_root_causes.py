"""A failed run's cause is its root cause in its own words, on every path: a shell's error line (locally, over SSH
and through the `pct` stand-in over the loopback sshd), a full disk; a foreign progress bar's step is the number
the step pattern means. Real agents, real tmux (private socket), real files."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.agent import end_runs
from support.waiting import wait_until

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]

SHELL_SAYS = "bash: start_training.sh: No such file or directory"


@pytest.fixture
def ended_root(run_root: Path) -> Iterator[Path]:
    try:
        yield run_root
    finally:
        end_runs(run_root)


def _missing_script_is_named(cli: Callable[..., Any], where: list[str], ended_root: Path) -> None:
    common = [*where, "--run-root", str(ended_root)]
    launch = ["launch", *common, "--cwd", str(ended_root), "--wait", "first-step", "--json"]
    r = cli(*launch, "--", "bash", "start_training.sh")
    assert r.returncode == 1, r.output
    obj = json.loads(r.stdout)
    assert obj["exit_code"] == 127, obj
    assert obj["cause"] == f"{SHELL_SAYS}; exit code 127; no step reached", obj
    run = json.loads(cli("status", *common, "--json").stdout)["run"]
    assert run["state"] == "failed" and run["cause"] == obj["cause"], run


def test_a_missing_script_is_named_in_the_shells_own_words_locally(cli: Callable[..., Any], ended_root: Path) -> None:
    _missing_script_is_named(cli, ["local"], ended_root)


@pytest.mark.parametrize("pct", [False, True], ids=["ssh", "ssh+pct"])
def test_a_missing_script_is_named_in_the_shells_own_words_over_ssh_and_pct(
    pct: bool, sshd: Any, cli: Callable[..., Any], ended_root: Path
) -> None:
    hop = ["--pct", str(sshd.pct_ctid)] if pct else []
    _missing_script_is_named(cli, [sshd.target, *sshd.args(), *hop], ended_root)


def test_a_job_that_fills_the_run_roots_disk_ends_with_no_space_left_as_its_cause(
    cli: Callable[..., Any], tiny_tmpfs: Path
) -> None:
    root = tiny_tmpfs / "run-root"
    root.mkdir()
    try:
        fill = "import os\nwhile True:\n    os.write(1, b'x' * 65536)\n"  # ENOSPC raises; its traceback has no room
        r = cli("launch", "local", "--run-root", str(root), "--wait", "first-step", "--json", "--", sys.executable,
                "-c", fill)  # fmt: skip
        assert r.returncode == 1, r.output
        obj = json.loads(r.stdout)
        assert obj["exit_code"] == 1, obj
        print(f"\n[cause] {obj['cause']}")
        assert "No space left on device" in obj["cause"] and obj["cause"].endswith("; exit code 1; no step reached")
        run = json.loads(cli("status", "local", "--run-root", str(root), "--json").stdout)["run"]
        assert run["cause"] == obj["cause"], run
    finally:
        end_runs(root)


BAR = (
    "import sys, time\n"
    "for i in range(10, 100, 10):\n"
    "    sys.stdout.write(f'\\rtrain: {i}/1000 [00:0{i // 10}<01:30, 9.8it/s]')\n"
    "    sys.stdout.flush()\n"
    "time.sleep(120)\n"
)


@pytest.mark.parametrize("pattern", [r"\d+/1000", r"(\d+)/1000"], ids=["no-group", "group"])
def test_a_carriage_return_progress_bar_steps_by_the_number_the_pattern_means(
    pattern: str, cli: Callable[..., Any], ended_root: Path, tmp_path: Path
) -> None:
    config = tmp_path / "config.toml"
    config.write_text(
        f"[profiles.bar]\ncommand = {json.dumps([sys.executable, '-c', BAR])}\nstep_pattern = '{pattern}'\n"
    )
    common = ["local", "--run-root", str(ended_root), "--config", str(config), "--profile", "bar"]
    r = cli("launch", *common, "--wait", "first-step", "--json")
    assert r.returncode == 0, r.output

    def last_step() -> int | None:
        run = json.loads(cli("status", *common, "--json").stdout)["run"]
        return run["last_step"] if run["last_step"] == 90 else None

    assert wait_until(last_step, 20, "status to show step 90 of the bar") == 90
