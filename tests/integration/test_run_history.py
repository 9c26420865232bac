"""Failed runs say why, and past runs stay reachable: `status` (human, --json), `launch --wait`, `runs`, `--run ID`.

Real parts: the agent over the local transport, the supervisor's wrapper in the private tmux server, real
run directories; a fake two-rank job prints what torchrun prints when rank 1 raises at step 30.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.recorded import TORCHRUN_FAILURE_SUMMARY
from support.waiting import wait_until

from engine.supervisor import records

Cli = Callable[..., Any]

# Two "ranks" that step to 30, then rank 1 raises, rank 0 dies of the broken peer, and the launcher prints
# torchrun's ChildFailedError summary (its real layout) naming rank 1 as the root cause; exit code 1.
FAKE_TORCHRUN = (
    f"SUMMARY = {TORCHRUN_FAILURE_SUMMARY!r}\n"
    + r'''
import sys
steps = int(sys.argv[1])
for step in range(1, steps + 1):
    for rank in (0, 1):
        print(f"[rank{rank}]: step={step} loss={1.0 / step:.3f}")
print("""[rank0]: Traceback (most recent call last):
[rank0]:   File "train.py", line 9, in <module>
[rank0]:     dist.barrier()
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:36273.
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 8, in <module>
[rank1]:     raise RuntimeError("rank 1 exploded at step 30")
[rank1]: RuntimeError: rank 1 exploded at step 30
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
    sys.exit(main())
""", end="", flush=True)
print(SUMMARY, end="", flush=True)
sys.exit(1)
'''
)
ROOT_CAUSE = "torchrun: rank 1 (local_rank 1) exited with code 1: RuntimeError: rank 1 exploded at step 30"


def _wait_exit(run_root: Path, run_id: str, timeout_s: float = 20.0) -> None:
    exit_json = records.run_dir_for(run_root, run_id) / records.EXIT_JSON
    wait_until(exit_json.exists, timeout_s, f"run {run_id} to end ({exit_json.name})")


def _launch(cli: Cli, run_root: Path, *command: str, wait: str = "started") -> dict[str, Any]:
    r = cli("launch", "local", "--run-root", str(run_root), "--wait", wait, "--json", "--", *command)
    obj: dict[str, Any] = json.loads(r.stdout)
    obj["returncode"] = r.returncode
    return obj


def test_a_failed_torchrun_job_names_the_failing_rank_its_exception_exit_code_and_last_step(
    cli: Cli, run_root: Path, tmp_path: Path
) -> None:
    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    run_id = _launch(cli, run_root, sys.executable, str(script), "30")["run_id"]
    _wait_exit(run_root, run_id)
    r = cli("status", "local", "--run-root", str(run_root), "--json")
    run = json.loads(r.stdout)["run"]
    assert (run["state"], run["exit_code"], run["last_step"]) == ("failed", 1, 30), run
    assert run["cause"] == f"{ROOT_CAUSE}; exit code 1; last step 30"
    human = cli("status", "local", "--run-root", str(run_root)).stdout
    assert f"cause {ROOT_CAUSE}; exit code 1; last step 30" in human, human


def test_launch_wait_reports_the_root_cause_of_a_job_that_failed_before_its_milestone(
    cli: Cli, run_root: Path, tmp_path: Path
) -> None:
    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN.replace("step={step}", "warmup {step}"))
    res = _launch(cli, run_root, sys.executable, str(script), "3", wait="first-step")
    assert res["returncode"] == 1 and res["ok"] is False
    assert res["cause"] == f"{ROOT_CAUSE}; exit code 1; no step reached"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not installed")
def test_a_real_torchrun_whose_rank_1_raises_at_step_30_is_named(cli: Cli, run_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "import torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "rank = dist.get_rank()\n"
        "for step in range(1, 100):\n"
        "    print(f'rank {rank} step={step}', flush=True)\n"
        "    if rank == 1 and step == 30:\n"
        "        raise RuntimeError('rank 1 exploded at step 30')\n"
        "    dist.barrier()\n"
    )
    torchrun = str(Path(sys.executable).parent / "torchrun")
    argv = [torchrun if os.access(torchrun, os.X_OK) else "torchrun", "--standalone", "--nproc-per-node", "2"]
    run_id = _launch(cli, run_root, *argv, str(script))["run_id"]
    _wait_exit(run_root, run_id, 120)
    run = json.loads(cli("status", "local", "--run-root", str(run_root), "--json").stdout)["run"]
    assert run["state"] == "failed" and run["exit_code"] == 1, run
    assert run["cause"].startswith(
        "torchrun: rank 1 (local_rank 1) exited with code 1: RuntimeError: rank 1 exploded at step 30; exit code 1"
    ), run["cause"]
    assert run["last_step"] == 30, run


def test_past_runs_are_listed_and_reachable_by_id(cli: Cli, run_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    failed = _launch(cli, run_root, sys.executable, str(script), "30")["run_id"]
    _wait_exit(run_root, failed)
    ok = _launch(cli, run_root, sys.executable, "-c", "print('step=1'); print('all good')")["run_id"]
    _wait_exit(run_root, ok)

    listed = cli("runs", "local", "--run-root", str(run_root), "--json")
    assert listed.returncode == 0, listed.output
    runs = json.loads(listed.stdout)["runs"]
    assert [r["run_id"] for r in runs] == [ok, failed]  # newest first
    assert (runs[0]["state"], runs[0]["exit_code"], runs[0]["current"], runs[0]["cause"]) == ("exited", 0, True, None)
    assert (runs[1]["state"], runs[1]["last_step"], runs[1]["current"]) == ("failed", 30, False)
    assert runs[1]["cause"].startswith(ROOT_CAUSE) and runs[1]["duration_s"] >= 0
    human = cli("runs", "local", "--run-root", str(run_root)).stdout
    assert human.splitlines()[0].split() == [
        "id",
        "state",
        "started",
        "duration",
        "last",
        "step",
        "exit",
        "output",
        "cause",
    ]
    assert f"{ok} *" in human and ROOT_CAUSE in human, human

    # The past run's log, status and cause, by id; the current run is untouched.
    log = cli("logs", "local", "--run-root", str(run_root), "--run", failed, "-n", "2")
    assert log.returncode == 0 and log.stdout.splitlines()[-1] == "=" * 60, log.output
    past = json.loads(cli("status", "local", "--run-root", str(run_root), "--run", failed, "--json").stdout)["run"]
    assert past["run_id"] == failed and past["cause"].startswith(ROOT_CAUSE)
    human_past = cli("status", "local", "--run-root", str(run_root), "--run", failed).stdout
    assert f"run       {failed}  state failed" in human_past and f"cause {ROOT_CAUSE}" in human_past
    follow = cli("logs", "local", "--run-root", str(run_root), "--run", failed, "-n", "1", "-f")
    assert follow.returncode == 0 and "not the current run" in follow.stderr, follow.output


@pytest.mark.parametrize("bad", ["../../etc", "..", "a/b", "-x", "x" * 65, "20990101-000000-none"])
def test_a_bad_or_unknown_run_id_is_a_usage_error(cli: Cli, run_root: Path, bad: str) -> None:
    (run_root / "runs").mkdir()
    for command in ("logs", "status", "stacks"):
        r = cli(command, "local", "--run-root", str(run_root), f"--run={bad}")
        assert r.returncode == 2, (command, bad, r.output)
        assert "run" in r.stderr and "Traceback" not in r.stderr, r.stderr
