"""Every line the trainer writes to events.jsonl is one of engine.protocol's engine events, whole: decoded, it encodes
back to the same object, so no key the trainer wrote is one the readers drop."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import protocol
from engine.trainer.config import from_dict
from engine.trainer.run.loop import TrainingRun
from engine.trainer.threads import compile as guard
from engine.trainer.threads.metrics import EventLog, compile_listener

REPO = Path(__file__).resolve().parents[4]


def decoded_lines(path: Path) -> list[protocol.EngineEvent]:
    """Each line of ``path`` as its engine event; fails on a line whose decoding loses or changes a key."""
    events: list[protocol.EngineEvent] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        written = json.loads(line)
        ev = protocol.decode_engine_event(written)
        again = protocol.encode_engine_event(ev)
        dropped = sorted(set(written) - set(again))
        assert not dropped, f"line {number} ({written.get('kind')}): keys no dataclass field holds: {dropped}"
        assert again == written, f"line {number}: {written} decodes to {again}"
        events.append(ev)
    return events


def kinds(events: list[protocol.EngineEvent]) -> set[str]:
    return {ev.KIND for ev in events}


def specdec_train(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop(protocol.ENV_EVENTS_PATH, None)
    return subprocess.run(
        [sys.executable, "-m", "engine.trainer", *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_a_cpu_demo_run_and_its_export_write_only_whole_engine_events(tmp_path: Path) -> None:
    out = tmp_path / "run"
    short = ["steps=4", "eval_every=2", "eval_conversations=2", "eval_max_new_tokens=8", "eval_k=2"]
    short += ["checkpoint_every=2", "step_delay_s=0.0", "heartbeat_interval_s=0.2"]
    sets = [arg for s in short for arg in ("--set", s)]
    run = specdec_train("--preset", "cpu-demo", *sets, "--output-dir", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    exported = specdec_train("export", str(out), str(tmp_path / "export"))
    assert exported.returncode == 0, exported.stderr[-2000:]

    events = decoded_lines(out / "events.jsonl")
    assert kinds(events) == {"stage", "heartbeat", "step", "eval", "checkpoint", "run_end", "export"}
    data = [ev for ev in events if isinstance(ev, protocol.StageEvent) and ev.skipped is not None]
    assert len(data) == 1 and data[0].heldout is not None and data[0].cached is False
    steps = [ev for ev in events if isinstance(ev, protocol.StepEvent)]
    assert {(ev.thread, ev.step) for ev in steps} == {(f"drafter{d}", s) for d in (0, 1) for s in range(1, 5)}
    assert all(ev.lr is not None and ev.bucket in (128, 256) and not ev.skipped for ev in steps)
    assert {ev.lr for ev in steps} == {2e-3, 5e-4}  # the preset's sweep, one rate per drafter
    evals = [ev for ev in events if isinstance(ev, protocol.EvalEvent)]
    assert len(evals) == 4 and all(ev.eval_s is not None and ev.counting == "stop" for ev in evals)
    beats = [ev for ev in events if isinstance(ev, protocol.HeartbeatEvent)]
    assert {ev.role for ev in beats} >= {"drafter", "producer"} and all(ev.beat_age_s is not None for ev in beats)
    (end,) = [ev for ev in events if isinstance(ev, protocol.RunEndEvent)]
    assert end.ok and end.step == 4 and end.degraded == []
    exports = [ev for ev in events if isinstance(ev, protocol.ExportEvent)]  # one per independent drafter
    assert [(ev.drafter, ev.step, ev.format) for ev in exports] == [(f"drafter{d}", 4, "eagle3") for d in (0, 1)]


def test_a_run_that_skips_a_gradient_and_loses_a_drafter_writes_only_whole_engine_events(
    tmp_path: Path, small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = from_dict(
        {
            "target": "tiny",
            "drafter_devices": ["cpu", "cpu"],
            "drafter_mode": "independent",
            "data": str(small_corpus),
            "buckets": [256],
            "batch_size": 2,
            "ttt_steps": 2,
            "draft_vocab_size": 96,
            "steps": 5,
            "on_thread_error": "continue",
            "output_dir": str(tmp_path),
            "heartbeat_interval_s": 0.2,
            "torch_threads": 1,
        }
    )
    events = EventLog(tmp_path / "events.jsonl", stdout=io.StringIO())
    engine = TrainingRun(cfg, events)
    engine.build()
    poisoned = engine.workers[0]
    poisoned.training.drafter.fc.weight.register_hook(lambda g: g * float("nan") if poisoned.step + 1 == 2 else g)

    def kill_drafter1(ev: dict[str, Any]) -> None:
        if ev["kind"] == "step" and ev["thread"] == "drafter1" and ev["step"] == 2:

            def boom(*_args: Any, **_kwargs: Any) -> Any:
                raise RuntimeError("injected failure")

            monkeypatch.setattr(engine.workers[1], "begin", boom)

    events.listeners.append(kill_drafter1)
    assert engine.run() == 0
    events.close()

    written = decoded_lines(tmp_path / "events.jsonl")
    assert {"nonfinite_grad", "thread_error", "run_end"} <= kinds(written)
    (skip,) = [ev for ev in written if isinstance(ev, protocol.NonFiniteGradEvent)]
    assert (skip.thread, skip.step, skip.grad_norm) == ("drafter0", 2, "nan")
    (error,) = [ev for ev in written if isinstance(ev, protocol.ThreadErrorEvent)]
    assert (error.thread, error.role, error.policy) == ("drafter1", "drafter", "continue")
    (end,) = [ev for ev in written if isinstance(ev, protocol.RunEndEvent)]
    assert end.ok and end.degraded == ["drafter1"]


def scaled(x: torch.Tensor, k: int) -> torch.Tensor:
    return x * k


def test_the_compile_guards_recompile_and_fallback_are_whole_engine_events(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl", stdout=io.StringIO(), tags={"rank": 1, "world_size": 2, "node": 0})
    fn = guard.GuardedFunction(scaled, compiled=True, name="ttt_step", backend="eager")
    fn.listeners.append(compile_listener(events))
    old_limit = guard.recompile_limit()
    errors: list[BaseException] = []

    def drafter_thread() -> None:
        try:
            guard.set_recompile_limit(3)
            guard.apply_dynamo_config()
            x = torch.randn(4)
            fn(x, 1)  # warm-up: one graph
            fn.mark_warm()
            fn(x, 2)  # a new graph after warm-up: a recompile
            fn(x, 3)  # the third graph: the limit, and another recompile
            fn(x, 4)  # past the limit: runs eagerly, a fallback
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    try:
        torch._dynamo.reset()
        th = threading.Thread(target=drafter_thread, name="drafter1")
        th.start()
        th.join(120.0)
    finally:
        guard.set_recompile_limit(old_limit)
        events.close()
    assert not th.is_alive() and not errors, errors
    written = decoded_lines(tmp_path / "events.jsonl")
    compiles = [ev for ev in written if isinstance(ev, protocol.CompileEvent)]
    assert len(compiles) == len(written) and [ev.what for ev in compiles] == ["recompile", "recompile", "fallback"]
    assert all((ev.rank, ev.world_size, ev.node, ev.thread) == (1, 2, 0, "drafter1") for ev in compiles)
