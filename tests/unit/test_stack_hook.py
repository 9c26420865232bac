"""The wrapper's sitecustomize: a supervised Python process registers the stack dump, and the sitecustomize it
shadows still runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.supervisor import stack_hook

PROBE = (
    "import os, signal, sitecustomize\n"
    "print('handler', callable(signal.getsignal(signal.SIGUSR1)))\n"
    "raw = os.path.join(os.environ['SPECDEC_RUN_DIR'], 'stacks', f'{os.getpid()}.faulthandler')\n"
    "print('raw', os.path.exists(raw))\n"
)


def run_probe(run_dir: Path, pythonpath: str) -> str:
    env = {"PATH": os.environ["PATH"], "SPECDEC_RUN_DIR": str(run_dir), "PYTHONPATH": pythonpath}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def test_a_python_job_registers_the_dump_and_the_shadowed_sitecustomize_still_runs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    users = tmp_path / "users-site"
    users.mkdir()
    (users / "sitecustomize.py").write_text("print('the user sitecustomize ran')\n")
    site = stack_hook.prepare(run_dir, {})
    assert site is not None
    env = stack_hook.with_hook({"PYTHONPATH": str(users)}, site)
    assert env["PYTHONPATH"] == f"{site}{os.pathsep}{users}"
    said = run_probe(run_dir, env["PYTHONPATH"])
    assert "handler True" in said and "raw True" in said, said
    assert "the user sitecustomize ran" in said, said


def test_the_hook_is_left_out_when_the_jobs_environment_opts_out(tmp_path: Path) -> None:
    assert stack_hook.prepare(tmp_path, {stack_hook.OPT_OUT_ENV: "0"}) is None
    assert not (tmp_path / stack_hook.SITE_DIR).exists()
