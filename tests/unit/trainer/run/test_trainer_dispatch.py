"""Several producers feeding the drafters: every batch index trained exactly once per epoch, resume included, and
with ``on_thread_error = "continue"`` the survivors of a dead drafter or producer keep training at full rate."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from test_trainer_engine import Recorder, build, make_config, raise_on_call  # same folder: on sys.path

from engine.trainer.checkpoint import latest_checkpoint, read_meta
from engine.trainer.data.dispatch import Dispatcher, IndexLedger
from engine.trainer.run.loop import TrainingRun

QUEUE_SIZE = 2
RUN_BOUND_S = 120.0  # a run that hangs fails the test instead of the test hanging


def test_ledger_keeps_a_watermark_and_the_indices_done_above_it() -> None:
    ledger = IndexLedger()
    for i in (0, 2, 5, 1):
        ledger.mark(i)
    assert ledger.state() == {"watermark": 3, "done": [5]} and ledger.trained == 4
    resumed = IndexLedger()
    resumed.restore(ledger.state())
    assert [i for i in range(8) if not resumed.is_done(i)] == [3, 4, 6, 7]
    dispatcher = Dispatcher([resumed], "replicas")
    assert [dispatcher.claim() for _ in range(3)] == [3, 4, 6]  # resumes at the gaps, skips what was trained
    dispatcher.release(4)  # its producer died: handed out again first
    assert [dispatcher.claim() for _ in range(2)] == [4, 7]


def record_trained(monkeypatch: pytest.MonkeyPatch, engine: TrainingRun) -> list[int]:
    """The batch index of every training step of every drafter (patched from outside)."""
    trained: list[int] = []
    lock = threading.Lock()
    for worker in engine.workers:
        original = worker.begin

        def step(batch: Any, fetch_ms: float, _original: Any = original) -> Any:
            with lock:
                trained.append(batch.index)
            return _original(batch, fetch_ms)

        monkeypatch.setattr(worker, "begin", step)
    return trained


def run_bounded(engine: TrainingRun) -> int:
    watchdog = threading.Timer(RUN_BOUND_S, engine.control.fail_run, args=("test bound: the run hung",))
    watchdog.start()
    try:
        return engine.run()
    finally:
        watchdog.cancel()


def position(out: Path) -> dict[str, Any]:
    ckpt = latest_checkpoint(out)
    assert ckpt is not None
    (pos,) = read_meta(ckpt)["data_position"].values()
    assert isinstance(pos, dict)
    return pos


@pytest.mark.parametrize(("drafters", "overlap"), [(1, "off"), (2, "off"), (2, "on")])
def test_two_producers_train_every_index_exactly_once_across_a_resume(
    tmp_path: Path, small_corpus: Path, monkeypatch: pytest.MonkeyPatch, drafters: int, overlap: str
) -> None:
    out = tmp_path / "run"
    common: dict[str, Any] = {
        "target_devices": ["cpu", "cpu"],
        "drafter_devices": ["cpu"] * drafters,
        "queue_size": QUEUE_SIZE,
        "batch_size": 1,
        "overlap_steps": overlap,  # on: each drafter takes its next batch before it reads the step before
    }
    first, _ = build(make_config(out, small_corpus, steps=10, **common), out)
    trained = record_trained(monkeypatch, first)
    assert run_bounded(first) == 0
    assert len(trained) == 10 * drafters and len(set(trained)) == len(trained)
    saved = position(out)
    assert set(trained) == set(range(saved["watermark"])) | set(saved["done"])  # the checkpoint holds what ran
    assert len(saved["done"]) <= 2 + drafters * QUEUE_SIZE  # gaps only from batches still in flight at the end

    resumed, _ = build(make_config(out, small_corpus, steps=20, **common), out)
    more = record_trained(monkeypatch, resumed)
    assert run_bounded(resumed) == 0
    assert len(more) == 10 * drafters and not set(more) & set(trained)
    everything = trained + more
    assert max(Counter(everything).values()) == 1
    final = position(out)
    assert set(everything) == set(range(final["watermark"])) | set(final["done"])
    assert set(saved["done"]) < set(everything) and final["watermark"] >= saved["watermark"] + len(saved["done"])


def steps_of(rec: Recorder, thread: str) -> list[int]:
    return [e["step"] for e in rec.of("step") if e["thread"] == thread]


@pytest.mark.parametrize("mode,producers", [("independent", 1), ("replicas", 2)])
def test_survivors_of_a_dead_drafter_keep_training_at_full_rate(
    tmp_path: Path, small_corpus: Path, monkeypatch: pytest.MonkeyPatch, mode: str, producers: int
) -> None:
    steps = 2 + 12 * QUEUE_SIZE  # long past the point where every queue of the old routing would be full
    cfg = make_config(
        tmp_path,
        small_corpus,
        target_devices=["cpu"] * producers,
        drafter_devices=["cpu", "cpu"],
        drafter_mode=mode,
        queue_size=QUEUE_SIZE,
        batch_size=1,
        steps=steps,
        on_thread_error="continue",
    )
    engine, rec = build(cfg, tmp_path)
    trained = record_trained(monkeypatch, engine)

    def kill_drafter1(ev: dict[str, Any]) -> None:
        if ev["kind"] == "step" and ev["thread"] == "drafter1" and ev["step"] == 2:
            raise_on_call(monkeypatch, engine.workers[1], "begin", RuntimeError("drafter1 lost its GPU"))

    rec.actions.append(kill_drafter1)
    assert run_bounded(engine) == 0, rec.of("run_end")
    end = rec.of("run_end")[-1]
    assert end["ok"] and end["degraded"] == ["drafter1"]
    survivor = steps_of(rec, "drafter0")
    assert survivor == list(range(1, steps + 1))  # every step, up to the end
    if mode == "replicas":  # drafter1's share went to drafter0: nothing lost, nothing twice
        assert max(Counter(trained).values()) == 1
        pos = position(tmp_path)
        assert set(trained) >= set(range(pos["watermark"])) | set(pos["done"])


def test_a_dead_producers_share_is_taken_over_by_the_live_one(
    tmp_path: Path, small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = 2 + 12 * QUEUE_SIZE
    cfg = make_config(
        tmp_path,
        small_corpus,
        target_devices=["cpu", "cpu"],
        queue_size=QUEUE_SIZE,
        batch_size=1,
        steps=steps,
        on_thread_error="continue",
    )
    engine, rec = build(cfg, tmp_path)
    trained = record_trained(monkeypatch, engine)
    calls = 0
    original = engine.producers[1].compute

    def flaky(index: int) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("target1 lost its GPU")
        return original(index)

    monkeypatch.setattr(engine.producers[1], "compute", flaky)
    assert run_bounded(engine) == 0, rec.of("run_end")
    assert [e["thread"] for e in rec.of("thread_error")] == ["target1"]
    assert steps_of(rec, "drafter0") == list(range(1, steps + 1))
    assert sorted(trained) == list(range(steps))  # the index target1 died on was produced by target0
    beats = [e["step"] for e in rec.of("heartbeat") if e["thread"] == "target0"]
    assert beats[-1] >= steps - calls


def test_producer_heartbeat_step_goes_on_from_the_resumed_position(tmp_path: Path, small_corpus: Path) -> None:
    first, _ = build(make_config(tmp_path, small_corpus, steps=4, queue_size=QUEUE_SIZE), tmp_path)
    assert first.run() == 0
    resumed, rec = build(make_config(tmp_path, small_corpus, steps=7, queue_size=QUEUE_SIZE), tmp_path)
    assert resumed.run() == 0
    beats = [e["step"] for e in rec.of("heartbeat") if e["thread"] == "target0"]
    assert beats and min(beats) >= 4 and max(beats) >= 7, beats


def test_checkpoint_meta_names_the_trained_indices(tmp_path: Path, small_corpus: Path) -> None:
    engine, _ = build(make_config(tmp_path, small_corpus, steps=3), tmp_path)
    assert engine.run() == 0
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["data_position"] == {"replicas": {"watermark": 3, "done": []}}
