"""Under the supervisor the engine's relative output_dir lives in <run_root>/engine/ (stable across runs, so a
restart resumes), and the run directory links to its checkpoints; outside it, output_dir is left alone."""

from __future__ import annotations

from pathlib import Path

from engine.trainer.__main__ import link_checkpoints, place_output_dir
from engine.trainer.config import from_dict, preset


def test_relative_output_dir_goes_under_the_run_root_when_supervised(tmp_path: Path) -> None:
    run_dir = tmp_path / "root" / "runs" / "20261129-120000-ab12"
    run_dir.mkdir(parents=True)
    cfg = place_output_dir(preset("cpu-demo"), str(run_dir))
    assert Path(cfg.output_dir) == (tmp_path / "root" / "engine" / "runs" / "cpu-demo").resolve()
    again = place_output_dir(preset("cpu-demo"), str(tmp_path / "root" / "runs" / "20261129-130000-cd34"))
    assert again.output_dir == cfg.output_dir  # the next run (a restart) finds the same checkpoints


def test_absolute_output_dir_and_unsupervised_runs_are_left_alone(tmp_path: Path) -> None:
    cfg = preset("cpu-demo")
    assert place_output_dir(cfg, None).output_dir == "runs/cpu-demo"
    fixed = str(tmp_path / "out")
    supervised = str(tmp_path / "r" / "runs" / "x")
    assert place_output_dir(from_dict({"output_dir": fixed}, cfg), supervised).output_dir == fixed


def test_run_dir_links_to_the_engine_checkpoints(tmp_path: Path) -> None:
    run_dir = tmp_path / "root" / "runs" / "r1"
    run_dir.mkdir(parents=True)
    cfg = place_output_dir(preset("cpu-demo"), str(run_dir))
    link_checkpoints(cfg, str(run_dir))
    link = run_dir / "checkpoints"
    assert link.is_symlink() and link.resolve() == (Path(cfg.output_dir) / "checkpoints").resolve()
    link_checkpoints(cfg, str(run_dir))  # idempotent
