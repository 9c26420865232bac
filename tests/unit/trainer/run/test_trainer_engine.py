"""The engine end to end on the CPU: threads, errors and their policy, checkpoints and resume, learning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.waiting import wait_until

from engine import protocol
from engine.agent import anomalies
from engine.trainer.config import TrainerConfig, from_dict
from engine.trainer.run.loop import TrainingRun
from engine.trainer.threads.metrics import EventLog

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def small_corpus(corpus_head: Callable[[int], Path]) -> Path:
    return corpus_head(96)


def make_config(out: Path, data: Path | str, **overrides: Any) -> TrainerConfig:
    base: dict[str, Any] = {
        "target": "tiny",
        "target_devices": ["cpu"],
        "drafter_devices": ["cpu"],
        "drafter_mode": "replicas",
        "data": str(data),
        "buckets": [256],
        "batch_size": 2,
        "ttt_steps": 2,
        "draft_vocab_size": 96,
        "lr": 2e-3,
        "steps": 4,
        "output_dir": str(out),
        "heartbeat_interval_s": 0.2,
        "torch_threads": 1,
    }
    base.update(overrides)
    return from_dict(base)


class Recorder:
    """Collects events (with arrival times) and lets a test act on one from inside the emitting thread."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.times: list[float] = []
        self.actions: list[Callable[[dict[str, Any]], None]] = []

    def __call__(self, ev: dict[str, Any]) -> None:
        self.events.append(ev)
        self.times.append(time.monotonic())
        for fn in self.actions:
            fn(ev)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]


def raise_on_call(monkeypatch: pytest.MonkeyPatch, obj: object, method: str, exc: BaseException) -> None:
    """From the next call on, ``obj.method`` raises ``exc`` (patched from outside, as a user's code would)."""

    def boom(*_args: Any, **_kwargs: Any) -> Any:
        raise exc

    monkeypatch.setattr(obj, method, boom)


def build(cfg: TrainerConfig, out: Path) -> tuple[TrainingRun, Recorder]:
    events = EventLog(out / "events.jsonl", stdout=open(os.devnull, "w"))  # noqa: SIM115
    rec = Recorder()
    events.listeners.append(rec)
    engine = TrainingRun(cfg, events)
    engine.build()
    return engine, rec


def test_checkpoint_resume_gives_bitwise_the_same_next_step(tmp_path: Path, small_corpus: Path) -> None:
    straight, _ = build(make_config(tmp_path / "a", small_corpus, steps=3), tmp_path / "a")
    assert straight.run() == 0
    first, _ = build(make_config(tmp_path / "b", small_corpus, steps=2), tmp_path / "b")
    assert first.run() == 0
    assert first.last_checkpoint == tmp_path / "b" / "checkpoints" / "step_00000002"
    assert (first.last_checkpoint / "meta.json").exists()
    resumed, rec = build(make_config(tmp_path / "b", small_corpus, steps=3), tmp_path / "b")
    assert resumed.resumed_from is not None and resumed.workers[0].step == 2
    assert resumed.run() == 0
    assert [e["step"] for e in rec.of("step")] == [3]
    (ev,) = rec.of("step")
    assert ev["loss_total"] == pytest.approx(sum(0.8**i * x for i, x in enumerate(ev["loss"])))
    a, b = straight.workers[0], resumed.workers[0]
    assert a.last_result is not None and b.last_result is not None
    assert a.last_result.loss == b.last_result.loss
    assert a.last_result.acc == b.last_result.acc
    for (name, pa), pb in zip(a.training.drafter.named_parameters(), b.training.drafter.parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_replicas_resumed_on_one_device_stay_identical(tmp_path: Path, small_corpus: Path) -> None:
    """Replicas restored from one checkpoint each get optimizer moments of their own (shared moments would be
    updated once per replica and step)."""

    def replicas(steps: int) -> TrainerConfig:
        return make_config(tmp_path, small_corpus, drafter_devices=["cpu", "cpu"], steps=steps)

    first, _ = build(replicas(2), tmp_path)
    assert first.run() == 0
    resumed, _ = build(replicas(4), tmp_path)
    assert resumed.resumed_from is not None
    assert resumed.run() == 0
    a, b = resumed.workers
    assert a.step == b.step == 4
    for (name, pa), pb in zip(a.training.drafter.named_parameters(), b.training.drafter.parameters(), strict=True):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("policy", ["stop", "continue"])
def test_injected_drafter_exception_is_reported_within_a_second_and_policy_applies(
    tmp_path: Path, small_corpus: Path, policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(
        tmp_path,
        small_corpus,
        drafter_devices=["cpu", "cpu"],
        drafter_mode="independent",
        steps=8,
        on_thread_error=policy,
    )
    engine, rec = build(cfg, tmp_path)
    injected_at: list[float] = []

    def inject(ev: dict[str, Any]) -> None:
        if ev["kind"] == "step" and ev["thread"] == "drafter1" and ev["step"] == 2 and not injected_at:
            raise_on_call(monkeypatch, engine.workers[1], "begin", RuntimeError("injected failure"))
            injected_at.append(time.monotonic())

    rec.actions.append(inject)
    code = engine.run()
    errors = rec.of("thread_error")
    assert len(errors) == 1 and errors[0]["thread"] == "drafter1" and errors[0]["policy"] == policy
    assert "injected failure" in errors[0]["message"] and "RuntimeError" in errors[0]["traceback"]
    err_time = rec.times[rec.events.index(errors[0])]
    assert err_time - injected_at[0] < 1.0
    end = rec.of("run_end")[-1]
    if policy == "stop":
        assert code == 1 and end["ok"] is False and "drafter1" in end["reason"]
        assert engine.workers[0].step < 8
    else:
        assert code == 0 and end["ok"] is True and end["degraded"] == ["drafter1"]
        assert engine.workers[0].step == 8
        assert any("degraded" in e.get("detail", "") for e in rec.of("stage"))
    beats = [e for e in rec.of("heartbeat") if e["thread"] == "drafter1"]
    assert beats[-1]["state"] == "error" and "injected failure" in beats[-1]["last_exception"]


def test_producer_exception_reaches_the_engine(
    tmp_path: Path, small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, rec = build(make_config(tmp_path, small_corpus, steps=50), tmp_path)

    def inject(ev: dict[str, Any]) -> None:
        if ev["kind"] == "step" and ev["step"] == 2:
            raise_on_call(monkeypatch, engine.producers[0], "compute", ValueError("target exploded"))

    rec.actions.append(inject)
    assert engine.run() == 1
    errors = rec.of("thread_error")
    assert [e["thread"] for e in errors] == ["target0"]
    end = rec.of("run_end")[-1]
    assert end["ok"] is False and "target0" in end["reason"] and "target exploded" in end["reason"]
    assert engine.workers[0].step < 50


def test_a_producer_failure_is_the_one_thread_error_while_a_drafter_waits_on_its_queue(
    tmp_path: Path, small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The drafter is blocked in its queue's get when the producer fails: the failure wakes it (queue.fail), and it
    ends with the run instead of being reported as a second failed thread (on a loaded machine the usual case)."""
    engine, rec = build(make_config(tmp_path, small_corpus, steps=5), tmp_path)
    worker = engine.workers[0]

    def compute(*_args: Any, **_kwargs: Any) -> Any:
        assert worker.warm.wait(60)
        time.sleep(0.5)  # the drafter is in its queue's get by now: nothing was produced
        raise ValueError("target exploded")

    monkeypatch.setattr(engine.producers[0], "compute", compute)
    assert engine.run() == 1
    assert [e["thread"] for e in rec.of("thread_error")] == ["target0"]
    end = rec.of("run_end")[-1]
    assert end["ok"] is False and "target0" in end["reason"] and "target exploded" in end["reason"]
    assert worker.step == 0


def test_nan_loss_stops_the_run_naming_step_and_thread(tmp_path: Path, small_corpus: Path) -> None:
    engine, rec = build(make_config(tmp_path, small_corpus, steps=20, on_thread_error="continue"), tmp_path)

    def poison(ev: dict[str, Any]) -> None:
        if ev["kind"] == "step" and ev["step"] == 2:
            with torch.no_grad():
                engine.workers[0].training.drafter.lm_head.weight.fill_(float("nan"))

    rec.actions.append(poison)
    assert engine.run() == 1
    err = rec.of("thread_error")[0]
    assert err["exc_type"] == "NonFiniteLoss" and err["policy"] == "stop"
    assert "step 3" in err["message"] and "drafter0" in err["message"]


def test_two_drafter_threads_learn_on_the_shipped_corpus(tmp_path: Path) -> None:
    cfg = make_config(
        tmp_path,
        "shipped",
        drafter_devices=["cpu", "cpu"],
        drafter_mode="replicas",
        steps=70,
        ttt_steps=2,
        buckets=[128, 256],
        draft_vocab_size=128,
        # 4 layers: the captured high layer is the last one, so 70 steps show learning (measured: acc0
        # 0.015 -> 0.19; the 8-layer default, whose last 3 layers the drafter never sees, reaches 0.09).
        tiny_layers=4,
    )
    engine, rec = build(cfg, tmp_path)
    assert engine.run() == 0
    steps = rec.of("step")
    assert {e["thread"] for e in steps} == {"drafter0", "drafter1"}
    acc0 = [e["acc"][0] for e in steps if e["thread"] == "drafter0"]
    start, end = sum(acc0[:3]) / 3, sum(acc0[-15:]) / 15
    assert start < 0.1 and end > start + 0.15, (start, end)
    # Replicas stay identical: gradients are averaged every step.
    for pa, pb in zip(
        engine.workers[0].training.drafter.parameters(), engine.workers[1].training.drafter.parameters(), strict=True
    ):
        assert torch.equal(pa, pb)


def test_head_on_trained_rows_trains_what_every_row_trains(tmp_path: Path, small_corpus: Path) -> None:
    """head_positions "trained" (the default: the producer gathers each TTT step's trained rows) against "all":
    the same batches give the same losses and accuracies step by step, and the same weights at the end."""
    got = {}
    for mode in ("trained", "all"):
        cfg = make_config(tmp_path / mode, small_corpus, steps=6, log_every=1, head_positions=mode)
        engine, rec = build(cfg, tmp_path / mode)
        assert engine.run() == 0
        steps = rec.of("step")
        assert [e["step"] for e in steps] == list(range(1, 7))
        got[mode] = (steps, [p.detach().clone() for p in engine.workers[0].training.drafter.parameters()])
    for a, b in zip(got["trained"][0], got["all"][0], strict=True):
        assert a["acc"] == b["acc"], (a["step"], a["acc"], b["acc"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
    for pa, pb in zip(got["trained"][1], got["all"][1], strict=True):
        torch.testing.assert_close(pa, pb, rtol=1e-4, atol=1e-6)


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


def test_sigterm_saves_a_checkpoint_exits_zero_and_restart_resumes(tmp_path: Path, small_corpus: Path) -> None:
    out = tmp_path / "run"
    events = out / "events.jsonl"
    args = [
        sys.executable,
        "-m",
        "engine.trainer",
        "--preset",
        "cpu-demo",
        "--output-dir",
        str(out),
        "--set",
        f'data="{small_corpus}"',
        "--set",
        "buckets=[256]",
        "--set",
        'drafter_devices=["cpu"]',
        "--set",
        "step_delay_s=0.02",
        "--set",
        "drafter_lrs=[2e-3]",
    ]
    env = {**os.environ, "SPECDEC_EVENTS": str(events), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def stepped() -> bool:
            if any(e["kind"] == "step" and e["step"] >= 3 for e in read_events(events)):
                return True
            assert proc.poll() is None, f"the engine exited with {proc.returncode} first:\n{proc.communicate()[0]}"
            return False

        wait_until(stepped, 90, "step 3 in the engine's events", interval_s=0.05)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    evs = read_events(events)
    saved = [e for e in evs if e["kind"] == "checkpoint"][-1]
    end = [e for e in evs if e["kind"] == "run_end"][-1]
    assert end["ok"] is True and end["reason"] == "SIGTERM" and end["step"] == saved["step"]
    assert Path(saved["path"]).is_dir() and "step=" in output
    # Restart: resumes at the saved step and runs two more.
    args2 = [*args, "--set", f"steps={saved['step'] + 2}"]
    done = subprocess.run(args2, cwd=REPO, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"at step {saved['step']}" in done.stdout
    after = read_events(events)[len(evs) :]
    assert [e["step"] for e in after if e["kind"] == "step"] == [saved["step"] + 1, saved["step"] + 2]


def test_a_replica_waiting_for_a_slow_peer_beats_as_syncing_and_is_not_flagged(
    tmp_path: Path, small_corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = make_config(tmp_path, small_corpus, drafter_devices=["cpu", "cpu"], steps=3, stall_after_s=1.0)
    engine, rec = build(cfg, tmp_path)
    slow = engine.workers[0]
    step = slow.begin

    def slow_second_step(*args: Any, **kwargs: Any) -> Any:
        if slow.step == 1:
            time.sleep(2.5)  # as long as an evaluation between two steps: its peer waits at the gradient barrier
        return step(*args, **kwargs)

    monkeypatch.setattr(slow, "begin", slow_second_step)
    assert engine.run() == 0
    waiting = [e for e in rec.of("heartbeat") if e["thread"] == "drafter1" and e["state"] == "syncing"]
    assert len(waiting) >= 3, [(e["thread"], e["state"]) for e in rec.of("heartbeat")]
    assert max(e["beat_age_s"] for e in waiting) < 1.0  # beating while it waits: its heartbeats never age
    assert "stalled" not in {flag for e in rec.of("heartbeat") if e["thread"] == "drafter1" for flag in e["flags"]}


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _poison_gradients(engine: TrainingRun, steps: Callable[[int], bool]) -> None:
    """Replica 0's fc gradient turns NaN on the steps ``steps`` picks (the worker's step + 1 is the one computed)."""
    worker = engine.workers[0]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan") if steps(worker.step + 1) else grad

    worker.training.drafter.fc.weight.register_hook(hook)


def test_a_nan_gradient_skips_the_step_on_every_replica_and_never_reaches_a_checkpoint(
    tmp_path: Path, small_corpus: Path
) -> None:
    cfg = make_config(
        tmp_path, small_corpus, steps=6, drafter_devices=["cpu", "cpu"], checkpoint_every=1, keep_checkpoints=10
    )
    engine, rec = build(cfg, tmp_path)
    _poison_gradients(engine, lambda step: step in (3, 4))
    assert engine.run() == 0
    skipped = sorted((e["thread"], e["step"]) for e in rec.of("nonfinite_grad"))
    assert skipped == [("drafter0", 3), ("drafter0", 4), ("drafter1", 3), ("drafter1", 4)], skipped
    assert all(e["grad_norm"] == "nan" for e in rec.of("nonfinite_grad"))
    steps = {(e["thread"], e["step"]): e for e in rec.of("step")}
    assert steps[("drafter0", 3)]["skipped"] is True and "grad_norm" not in steps[("drafter0", 3)]  # null: not written
    assert steps[("drafter0", 5)]["skipped"] is False
    ckpts = sorted((tmp_path / "checkpoints").glob("step_*"))
    assert len(ckpts) >= 5, ckpts
    for ckpt in ckpts:
        for f in ckpt.glob("*.pt"):
            for t in _tensors(torch.load(f, map_location="cpu", weights_only=True)):
                assert not (t.is_floating_point() and not torch.isfinite(t).all()), f"non-finite values in {f}"
    # The skipped steps changed nothing: the weights after step 4 are those after step 2.
    after2 = torch.load(tmp_path / "checkpoints" / "step_00000002" / "replicas.pt", weights_only=True)["model"]
    after4 = torch.load(tmp_path / "checkpoints" / "step_00000004" / "replicas.pt", weights_only=True)["model"]
    assert all(torch.equal(after2[k], after4[k]) for k in after2)
    # The agent turns the events into one anomaly per thread.
    state = anomalies.EngineState()
    for raw in rec.events:
        state.feed(protocol.decode_engine_event(raw))  # every event the trainer wrote decodes
    found = [a for a in anomalies.engine_anomalies(state, time.time(), True) if a.kind == "nonfinite_grad"]
    assert [a.thread for a in found] == ["drafter0", "drafter1"]
    assert "2 step(s) skipped for non-finite gradients (last at step 4, norm nan)" in found[0].message


def test_gradients_that_stay_non_finite_stop_the_run_with_that_cause(tmp_path: Path, small_corpus: Path) -> None:
    engine, rec = build(make_config(tmp_path, small_corpus, steps=20, nonfinite_grad_limit=3), tmp_path)
    _poison_gradients(engine, lambda step: step >= 2)
    assert engine.run() == 1
    err = rec.of("thread_error")[0]
    assert err["exc_type"] == "NonFiniteGradient", err
    assert "for 3 steps in a row, the last at step 4 in thread drafter0" in err["message"]
