"""A run resumed after a crash says how many steps it lost since the checkpoint it resumes from.
(The SIGKILL version through the supervisor is in tests/adversarial/test_engine_signals.py.)"""

from __future__ import annotations

import shutil
from pathlib import Path

from test_trainer_engine import build, make_config  # same folder: pytest puts it on sys.path

from engine.trainer.checkpoint import ProgressRecord


def test_progress_record_keeps_the_highest_step_atomically(tmp_path: Path) -> None:
    rec = ProgressRecord(tmp_path / "out")
    assert rec.last_recorded_step() is None
    for step in (1, 3, 2):
        rec.on_event({"kind": "step", "step": step, "t": 0.0})
    rec.on_event({"kind": "heartbeat", "step": 99})
    assert rec.last_recorded_step() == 3
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["progress.json"]


def test_resume_after_losing_the_newest_checkpoint_names_the_lost_steps(tmp_path: Path, small_corpus: Path) -> None:
    out = tmp_path / "run"
    first, _ = build(make_config(out, small_corpus, steps=3, checkpoint_every=1), out)
    assert first.run() == 0
    # As after a SIGKILL: step 3 ran, but its checkpoint never reached the disk.
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    resumed, rec = build(make_config(out, small_corpus, steps=4, checkpoint_every=1), out)
    assert resumed.workers[0].step == 2
    said = [e["detail"] for e in rec.of("stage") if "lost" in e.get("detail", "")]
    assert said == [
        "resumed from step_00000002: lost 1 step(s) since that checkpoint (the previous run reached step 3)"
    ]
