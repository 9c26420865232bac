"""Steps without host waits: the fused optimizer clips and skips on the device, and with ``overlap_steps`` a drafter
launches its next forward before it reads the step just launched. On the CPU (``overlap_steps = "on"``, where the
default leaves it off) the order is the same as on a GPU, so what it may change is checked here: nothing trained
differs, every batch is trained once, and a stop or a checkpoint sees only finished steps."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_trainer_dispatch import position, run_bounded  # same folder: on sys.path
from test_trainer_engine import build, make_config

from engine.trainer.checkpoint import read_meta
from engine.trainer.run.loop import TrainingRun
from engine.trainer.run.worker import clipped_step


@pytest.fixture(scope="module")
def small_corpus(corpus_head: Any) -> Path:
    path: Path = corpus_head(96)
    return path


def params_with_grads(scale: float, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(7, 5, generator=g)), torch.nn.Parameter(torch.randn(11, generator=g))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * scale
    return params


def adamw(params: list[torch.nn.Parameter], fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, betas=(0.9, 0.95), weight_decay=0.1, fused=fused)


@pytest.mark.parametrize("scale", [10.0, 0.01], ids=["clipped", "under-the-limit"])
def test_a_fused_clipped_step_equals_clip_grad_norm_then_the_step(scale: float) -> None:
    ours = params_with_grads(scale)
    ref = params_with_grads(scale)
    opt, ref_opt = adamw(ours, fused=True), adamw(ref, fused=True)
    for _ in range(3):  # moments and step counts carry over
        norm = clipped_step(opt, ours, max_norm=1.0)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        ref_opt.step()
        torch.testing.assert_close(norm, ref_norm, rtol=0, atol=0)  # the norm before clipping, as clip_grad_norm_
        for p in ours + ref:
            p.grad = torch.full_like(p, scale)
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")  # handed over for one step only
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # g / (1 / c) against g * c: the last bit
    assert not all(torch.equal(a, b) for a, b in zip(params_with_grads(scale), ours, strict=True))


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_norm_leaves_weights_moments_and_step_count_as_they_were(fused: bool, bad: float) -> None:
    params = params_with_grads(1.0)
    opt = adamw(params, fused=fused)
    clipped_step(opt, params, max_norm=1.0)
    before = [p.detach().clone() for p in params]
    state = {k: v.clone() for k, v in opt.state[params[0]].items()}
    for p in params:
        p.grad = torch.ones_like(p)
    params[1].grad[3] = bad
    norm = clipped_step(opt, params, max_norm=1.0)
    assert not torch.isfinite(norm)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all(torch.equal(opt.state[params[0]][k], v) for k, v in state.items())  # step count included
    for p in params:
        p.grad = torch.ones_like(p)
    clipped_step(opt, params, max_norm=1.0)  # and the next finite step updates as usual
    assert not torch.equal(params[0], before[0])
    assert float(opt.state[params[0]]["step"]) == float(state["step"]) + 1


def spy_order(engine: TrainingRun) -> list[tuple[str, int]]:
    """("begin" | "report", batch index) in the order the worker calls them. The worker's look for a next batch
    waits for one here: which steps launch ahead then depends on the worker alone, not on the producer's pace."""
    worker = engine.workers[0]
    calls: list[tuple[str, int]] = []
    lock = threading.Lock()
    begin, report, fetch = worker.begin, worker.report, worker._fetch
    worker._fetch = lambda *, block=True: fetch(block=True)  # type: ignore[method-assign]

    def spy_begin(batch: Any, fetch_ms: float) -> Any:
        with lock:
            calls.append(("begin", batch.index))
        return begin(batch, fetch_ms)

    def spy_report(pending: Any) -> Any:
        with lock:
            calls.append(("report", pending.launched.batch.index))
        return report(pending)

    worker.begin = spy_begin  # type: ignore[method-assign]
    worker.report = spy_report  # type: ignore[method-assign]
    return calls


def run_steps(tmp_path: Path, corpus: Path, overlap: str, **extra: Any) -> tuple[TrainingRun, Any, list[Any]]:
    out = tmp_path / overlap
    engine, rec = build(make_config(out, corpus, steps=6, overlap_steps=overlap, **extra), out)
    calls = spy_order(engine)
    assert run_bounded(engine) == 0, rec.of("run_end")
    return engine, rec, calls


def test_overlapped_steps_train_exactly_what_steps_one_after_another_train(tmp_path: Path, small_corpus: Path) -> None:
    plain, plain_rec, plain_calls = run_steps(tmp_path, small_corpus, "off")
    ahead, rec, calls = run_steps(tmp_path, small_corpus, "on")
    assert [e["step"] for e in rec.of("step")] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(plain_rec.of("step"), rec.of("step"), strict=True):
        assert (a["loss"], a["acc"], a["grad_norm"], a["lr"]) == (b["loss"], b["acc"], b["grad_norm"], b["lr"])
    for (name, pa), pb in zip(
        plain.workers[0].training.drafter.named_parameters(),
        ahead.workers[0].training.drafter.parameters(),
        strict=True,
    ):
        assert torch.equal(pa, pb), name
    # One after another: begin n, report n. Overlapped: begin n + 1 comes before report n, except after the last.
    assert plain_calls == [(k, i) for i in [c[1] for c in plain_calls[::2]] for k in ("begin", "report")]
    batches = [i for kind, i in calls if kind == "begin"]
    assert len(batches) == 6 and len(set(batches)) == 6
    expected = [("begin", batches[0])]
    for n, index in enumerate(batches):
        expected += [("begin", batches[n + 1])] if n + 1 < len(batches) else []
        expected += [("report", index)]
    assert calls == expected


def test_no_forward_is_launched_ahead_of_a_checkpointed_step(tmp_path: Path, small_corpus: Path) -> None:
    _, _, calls = run_steps(tmp_path, small_corpus, "on", checkpoint_every=3, keep_checkpoints=5)
    reported = [i for kind, i in calls if kind == "report"]
    third = calls.index(("report", reported[2]))
    # Step 3 is read with nothing launched after it (its checkpoint's state is step 3's); step 4 is launched then.
    assert calls[third - 1 : third + 2] == [("report", reported[1]), ("report", reported[2]), ("begin", reported[3])]
    (meta,) = read_meta(tmp_path / "on" / "checkpoints" / "step_00000003")["data_position"].values()
    assert set(range(meta["watermark"])) | set(meta["done"]) == set(reported[:3])


def test_a_stop_drops_the_forward_launched_ahead_and_the_resume_trains_its_batch(
    tmp_path: Path, small_corpus: Path
) -> None:
    out = tmp_path / "run"
    engine, rec = build(make_config(out, small_corpus, steps=20, overlap_steps="on"), out)
    calls = spy_order(engine)
    rec.actions.append(lambda ev: ev["kind"] == "step" and ev["step"] == 3 and engine.request_stop("test"))
    assert run_bounded(engine) == 0
    trained = [i for kind, i in calls if kind == "report"]
    launched = [i for kind, i in calls if kind == "begin"]
    assert len(trained) == 3 and len(launched) == 4  # step 4's forward was launched, then dropped at the stop
    saved = position(out)
    assert set(range(saved["watermark"])) | set(saved["done"]) == set(trained)  # the checkpoint holds what ran
    resumed, _ = build(make_config(out, small_corpus, steps=5, overlap_steps="on"), out)
    more = spy_order(resumed)
    assert run_bounded(resumed) == 0
    again = [i for kind, i in more if kind == "report"]
    assert len(again) == 2 and launched[-1] in again and not set(again) & set(trained)
