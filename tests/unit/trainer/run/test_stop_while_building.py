"""A stop signal while the run is being built (the target loading, the data, the drafters) ends the build at the
next phase with LoadingStopped (exit 0, nothing trained), not after the compile warm-up and first step."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.trainer.config import from_dict
from engine.trainer.data.rows import LoadingStopped
from engine.trainer.run.dir_hold import hold_output_dir
from engine.trainer.run.loop import TrainingRun
from engine.trainer.run.torchrun import RankInfo
from engine.trainer.threads.metrics import EventLog

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def build_signalled_at(tmp_path: Path, when: Callable[[dict[str, Any]], bool]) -> tuple[TrainingRun, list[str]]:
    """Builds a tiny run and sends this process SIGTERM (as `stop` does) at the first event ``when`` accepts."""
    cfg = from_dict({"target": "tiny", "tiny_layers": 4, "data": "random", "buckets": [32], "batch_size": 2,
                     "steps": 3, "output_dir": str(tmp_path / "out")})  # fmt: skip
    events = EventLog(tmp_path / "events.jsonl", stdout=open(os.devnull, "w"))  # noqa: SIM115
    stages: list[str] = []
    sent: list[bool] = []

    def on_event(ev: dict[str, Any]) -> None:
        if ev["kind"] == "stage":
            stages.append(ev["stage"])
        if not sent and when(ev):
            sent.append(True)
            os.kill(os.getpid(), signal.SIGTERM)

    events.listeners.append(on_event)
    engine = TrainingRun(cfg, events)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    engine.install_signal_handlers()
    try:
        engine.build()
    except LoadingStopped:
        # build() itself gave up the output_dir: another trainer may start there at once
        hold_output_dir(Path(cfg.output_dir)).close()
        raise
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    engine.release_output_dir()
    return engine, stages


def test_sigterm_while_the_target_loads_ends_the_build_once_it_has_loaded(tmp_path: Path) -> None:
    with pytest.raises(LoadingStopped, match=r"^stopped \(SIGTERM\) while the target loaded$"):
        build_signalled_at(tmp_path, lambda ev: ev.get("stage") == "target_loaded")


def test_sigterm_once_the_data_is_read_ends_the_build_before_the_fp8_check_and_the_warm_up(tmp_path: Path) -> None:
    # The signal comes after the last place that looked before (the data's reading): the drafters' build ends it.
    with pytest.raises(LoadingStopped, match=r"^stopped \(SIGTERM\) while the drafters were built$"):
        build_signalled_at(tmp_path, lambda ev: ev.get("stage") == "data")


def test_without_a_signal_the_build_completes(tmp_path: Path) -> None:
    engine, stages = build_signalled_at(tmp_path, lambda _ev: False)
    assert engine.workers and "target_loaded" in stages


def test_a_rank_of_a_torchrun_world_leaves_the_stop_to_the_step_boundary(tmp_path: Path) -> None:
    # One rank leaving the build alone would leave its peers waiting in their first collective.
    cfg = from_dict({"target": "tiny", "output_dir": str(tmp_path / "out")})
    events = EventLog(tmp_path / "events.jsonl", stdout=open(os.devnull, "w"))  # noqa: SIM115
    single, rank = TrainingRun(cfg, events), TrainingRun(cfg, events, RankInfo(rank=1, world_size=2, launched=True))
    for engine in (single, rank):
        engine._signalled = "SIGTERM"
    with pytest.raises(LoadingStopped, match=r"^stopped \(SIGTERM\) while the target loaded$"):
        single._stop_if_signalled("the target loaded")
    rank._stop_if_signalled("the target loaded")  # noted; the run loop's stop takes it at the step boundary
