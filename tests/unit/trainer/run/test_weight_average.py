"""ema_decay: the drafter's weights averaged over the training steps, kept beside the trained ones, carried through
checkpoints and resume, and what export, eval and the in-run evaluation serve (the trained ones on request)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.trainer import checkpoint as ckpt
from engine.trainer.config import ConfigError, from_dict
from engine.trainer.draft.average import EMA_KEY, WeightAverage, served_weights
from engine.trainer.run.loop import TrainingRun
from engine.trainer.serve import export
from engine.trainer.serve.evaluate import load_drafter
from engine.trainer.threads.metrics import EventLog
from engine.trainer.verifier.model import load_target, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

DECAY = 0.9


def test_the_average_moves_as_the_formula_says_with_its_warm_up() -> None:
    layer = torch.nn.Linear(3, 2, bias=False)
    frozen = torch.nn.Linear(2, 2, bias=False).requires_grad_(False)
    module = torch.nn.ModuleDict({"layer": layer, "frozen": frozen})
    average = WeightAverage(module, DECAY)
    assert average.names == ["layer.weight"]  # trainable weights only
    expected = layer.weight.detach().clone()
    for t, value in enumerate([1.0, -2.0, 0.5, 3.0, 3.0]):
        with torch.no_grad():
            layer.weight.fill_(value)
        average.update()
        d = min(DECAY, (1 + t) / (10 + t))  # 0.1, 0.18, ...: the first steps count more while it warms up
        expected = d * expected + (1 - d) * value
        torch.testing.assert_close(average.shadow[0], expected, rtol=0, atol=1e-6)
    assert average.updates == 5
    twin = average.swapped_in(module)
    torch.testing.assert_close(twin["layer"].weight.detach(), expected, rtol=0, atol=1e-6)
    assert torch.equal(layer.weight, torch.full_like(layer.weight, 3.0))  # the trained module is untouched


def test_a_decay_outside_0_1_is_refused_by_the_config(tmp_path: Path) -> None:
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match="ema_decay"):
            from_dict({"target": "tiny", "ema_decay": bad, "output_dir": str(tmp_path)})
    assert from_dict({"target": "tiny", "ema_decay": 0.995, "output_dir": str(tmp_path)}).ema_decay == 0.995


def _config(out: Path, corpus: Path, steps: int, **extra: Any) -> Any:
    base = {
        "target": "tiny",
        "data": str(corpus),
        "buckets": [256],
        "batch_size": 2,
        "ttt_steps": 2,
        "draft_vocab_size": 96,
        "lr": 1e-2,
        "steps": steps,
        "output_dir": str(out),
        "torch_threads": 1,
        **extra,
    }
    return from_dict(base)


def _run(out: Path, corpus: Path, steps: int, **extra: Any) -> TrainingRun:
    with open(os.devnull, "w") as devnull:
        engine = TrainingRun(_config(out, corpus, steps, **extra), EventLog(out / "events.jsonl", stdout=devnull))
        engine.build()
        assert engine.run() == 0
    return engine


@pytest.fixture(scope="module")
def runs(corpus_head: Callable[[int], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Four steps straight with the average, the same run stopped after two and resumed, and four without it."""
    corpus, tmp = corpus_head(64), tmp_path_factory.mktemp("ema")
    straight = _run(tmp / "straight", corpus, 4, ema_decay=DECAY)
    _run(tmp / "resumed", corpus, 2, ema_decay=DECAY)
    resumed = _run(tmp / "resumed", corpus, 4, ema_decay=DECAY)
    plain = _run(tmp / "plain", corpus, 4)
    return {"tmp": tmp, "corpus": corpus, "straight": straight, "resumed": resumed, "plain": plain}


def test_training_is_the_same_with_the_average_and_it_survives_a_resume(runs: dict[str, Any]) -> None:
    straight, resumed, plain = runs["straight"].workers[0], runs["resumed"].workers[0], runs["plain"].workers[0]
    assert runs["resumed"].resumed_from is not None and resumed.step == straight.step == 4
    trained = dict(straight.training.drafter.named_parameters())
    for name, p in plain.training.drafter.named_parameters():
        assert torch.equal(p, trained[name]), name  # the optimizer steps the trained weights as before
    assert straight.average is not None and resumed.average is not None and plain.average is None
    assert straight.average.updates == resumed.average.updates == 4
    moved = 0
    for name, a, b in zip(straight.average.names, straight.average.shadow, resumed.average.shadow, strict=True):
        assert torch.equal(a, b), name  # restored from the step-2 checkpoint, then two more updates: bitwise
        moved += int(not torch.equal(a, trained[name].detach().float()))
    assert moved > 0  # the average is not the last weights


def test_export_and_eval_serve_the_average_and_the_trained_weights_on_request(runs: dict[str, Any]) -> None:
    tmp, worker = runs["tmp"], runs["straight"].workers[0]
    path, _ = ckpt.resolve_checkpoint(tmp / "straight")
    state = ckpt.load_drafter_state(path, "replicas")
    assert state[EMA_KEY]["decay"] == DECAY and state[EMA_KEY]["updates"] == 4
    average = dict(zip(worker.average.names, worker.average.shadow, strict=True))
    trained = dict(worker.training.drafter.named_parameters())
    results = {
        "average": export.export_checkpoint(tmp / "straight", tmp / "x-average", record=False),
        "trained": export.export_checkpoint(tmp / "straight", tmp / "x-trained", record=False, trained_weights=True),
    }
    assert results["average"].weights == f"moving average (decay {DECAY}, 4 steps)"
    assert results["trained"].weights == "trained"
    target = load_target("tiny", torch.device("cpu"), tokenizer=load_tokenizer("tiny"), layer_ids=None, seed=0,
                         dtype=torch.float32)  # fmt: skip
    for which, source in (("average", average), ("trained", trained)):
        config, tensors = export.read_export(tmp / f"x-{which}")
        assert config["specdec_export"]["weights"] == results[which].weights
        evaluated = load_drafter(path, "replicas", target, torch.device("cpu"), trained_weights=which == "trained")
        eval_state = evaluated.state_dict()
        for name in ("fc.weight", "lm_head.weight", "layer.q_proj.weight"):
            want = source[name].detach().to(torch.bfloat16)
            assert torch.equal(tensors[name], want), (which, name)
            assert torch.equal(eval_state[name], want.float()), (which, name)  # eval counts the drafter served


def test_an_average_that_does_not_fit_the_model_is_an_export_error(runs: dict[str, Any]) -> None:
    path, _ = ckpt.resolve_checkpoint(runs["tmp"] / "straight")
    state = ckpt.load_drafter_state(path, "replicas")
    state[EMA_KEY]["weights"]["fc.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"fc\.weight"):
        served_weights(state)
    assert served_weights(state, trained=True) == (state["model"], "trained")
    bad = runs["tmp"] / "bad"
    bad.mkdir()
    import shutil

    shutil.copytree(path, bad / "step_00000004")
    torch.save(state, bad / "step_00000004" / "replicas.pt")
    with pytest.raises(export.ExportError, match=r"replicas\.pt: the weight average's 'fc.weight'"):
        export.export_checkpoint(bad / "step_00000004", runs["tmp"] / "x-bad", record=False)
    assert not (runs["tmp"] / "x-bad").exists()


def test_the_in_run_evaluation_measures_the_average(
    corpus_head: Callable[[int], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.trainer.run.worker import DrafterWorker

    cfg = _config(tmp_path / "out", corpus_head(64), 2, ema_decay=DECAY, eval_every=2, eval_holdout=4,
                  eval_conversations=1, eval_max_new_tokens=4, eval_k=2)  # fmt: skip
    seen: list[Any] = []
    original = DrafterWorker.averaged_drafter

    def spy(self: DrafterWorker) -> Any:
        twin = original(self)
        seen.append(twin)
        return twin

    monkeypatch.setattr(DrafterWorker, "averaged_drafter", spy)
    with open(os.devnull, "w") as devnull:
        events = EventLog(tmp_path / "out" / "events.jsonl", stdout=devnull)
        engine = TrainingRun(cfg, events)
        engine.build()
        assert engine.run() == 0
    evals = [e for e in ckpt_events(tmp_path / "out") if e.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [2] and "error" not in evals[0]
    assert len(seen) == 1  # the step-2 evaluation ran on a copy holding the average
    worker = engine.workers[0]
    twin, trained = seen[0], worker.training.drafter
    assert twin is not trained
    assert twin.embed_weight.data_ptr() == trained.embed_weight.data_ptr()  # the table is shared, not copied
    assert worker.average is not None
    average = dict(zip(worker.average.names, worker.average.shadow, strict=True))
    for name, p in twin.named_parameters():
        assert torch.equal(p.detach(), average[name]), name


def ckpt_events(out: Path) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines() if line.strip()]


def test_a_resume_that_turns_the_average_off_says_so_and_one_that_turns_it_on_starts_it(
    corpus_head: Callable[[int], Path], tmp_path: Path
) -> None:
    corpus = corpus_head(64)
    _run(tmp_path / "off", corpus, 2, ema_decay=DECAY)
    off = _run(tmp_path / "off", corpus, 3)
    assert off.resumed_from is not None and off.workers[0].average is None
    stages = [e for e in ckpt_events(tmp_path / "off") if e.get("kind") == "stage" and "average" in e.get("detail", "")]
    assert len(stages) == 1 and "ema_decay 0.9" in stages[0]["detail"] and "dropped" in stages[0]["detail"]
    path, _ = ckpt.resolve_checkpoint(tmp_path / "off")
    assert EMA_KEY not in ckpt.load_drafter_state(path, "replicas")
    assert export.export_checkpoint(tmp_path / "off", tmp_path / "x-off", record=False).weights == "trained"

    _run(tmp_path / "on", corpus, 2)
    on = _run(tmp_path / "on", corpus, 3, ema_decay=DECAY)
    worker = on.workers[0]
    assert on.resumed_from is not None and worker.average is not None
    assert worker.average.updates == 1  # started from the resumed weights at step 2, then one step
    assert not [
        e for e in ckpt_events(tmp_path / "on") if e.get("kind") == "stage" and "average" in e.get("detail", "")
    ]
    path, _ = ckpt.resolve_checkpoint(tmp_path / "on")
    assert ckpt.load_drafter_state(path, "replicas")[EMA_KEY]["updates"] == 1
