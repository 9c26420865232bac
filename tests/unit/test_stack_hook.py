"""The wrapper's sitecustomize: a supervised Python process registers the stack dump, and the sitecustomize it
shadows still runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from engine.supervisor import stack_hook

REPO = Path(__file__).resolve().parents[2]

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


def markers_after(run_dir: Path, site: Path, code: str) -> tuple[bool, bool]:
    """(raw marker, hook marker) of a process that runs ``code`` under the hook."""
    probe = (
        code + "\nimport os\n"
        "base = os.path.join(os.environ['SPECDEC_RUN_DIR'], 'stacks', str(os.getpid()))\n"
        "print(os.path.exists(base + '.faulthandler'), os.path.exists(base + '.hook'))\n"
    )
    env = {
        "PATH": os.environ["PATH"],
        "SPECDEC_RUN_DIR": str(run_dir),
        "PYTHONPATH": stack_hook.with_hook({"PYTHONPATH": str(REPO)}, site)["PYTHONPATH"],
    }
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    raw, hook = done.stdout.split()
    return raw == "True", hook == "True"


def test_a_process_that_takes_sigusr1_or_sigusr2_itself_drops_out_of_the_hook(tmp_path: Path) -> None:
    """stacks signals only a process whose SIGUSR1 is still the hook's: a job's own handler (a save on
    pre-emption) must never be fired by a dump request."""
    site = stack_hook.prepare(tmp_path, {})
    assert site is not None
    assert markers_after(tmp_path, site, "pass") == (True, True)
    for signum in ("SIGUSR1", "SIGUSR2"):
        own = f"import signal\nsignal.signal(signal.{signum}, lambda *a: None)"
        assert markers_after(tmp_path, site, own) == (False, False), signum
    default = "import signal\nsignal.signal(signal.SIGUSR1, signal.SIG_DFL)"
    assert markers_after(tmp_path, site, default) == (False, False)


def test_our_engine_installing_its_dumps_takes_the_process_over_from_the_hook(tmp_path: Path) -> None:
    site = stack_hook.prepare(tmp_path, {})
    assert site is not None
    engine = "import os\nfrom engine import stackdump\nstackdump.install(os.environ['SPECDEC_RUN_DIR'])"
    assert markers_after(tmp_path, site, engine) == (True, False)  # signalled as the engine, not as a hooked job


def test_a_forked_child_that_takes_sigusr1_leaves_its_parents_markers(tmp_path: Path) -> None:
    site = stack_hook.prepare(tmp_path, {})
    assert site is not None
    fork = (
        "import os, signal\npid = os.fork()\n"
        "if pid == 0:\n    signal.signal(signal.SIGUSR1, lambda *a: None)\n    os._exit(0)\n"
        "os.waitpid(pid, 0)"
    )
    assert markers_after(tmp_path, site, fork) == (True, True)
