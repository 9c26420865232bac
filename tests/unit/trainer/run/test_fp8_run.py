"""An FP8 run (target_fp8): τ is measured against the exact target, and the run starts by measuring how far the
FP8 target is from it (the fp8_agreement stage, a warning below fp8_min_top1)."""

from __future__ import annotations

import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.trainer.config import TrainerConfig, from_dict
from engine.trainer.data.sources import shipped_corpus_path
from engine.trainer.run.fp8_check import check_batches
from engine.trainer.serve.evaluate import DrafterProposer, evaluate, heldout_prompts, target_forward
from engine.trainer.threads.metrics import EventLog
from engine.trainer.verifier.agreement import compare_forwards
from engine.trainer.verifier.fp8 import exact_bytes
from engine.trainer.verifier.model import FrozenTarget, load_target, load_tokenizer

K = 3
MAX_NEW = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def tiny(*, fp8: bool, keep_exact: bool = False) -> FrozenTarget:
    tok = load_tokenizer("tiny")
    return load_target(
        "tiny",
        torch.device("cpu"),
        tokenizer=tok,
        layer_ids=None,
        seed=0,
        dtype=torch.float32,
        tiny_layers=4,
        fp8=fp8,
        keep_exact=keep_exact,
    )


class Fp8Oracle:
    """A drafter that learned the FP8 target perfectly: it proposes the FP8 forward's own greedy tokens."""

    def __init__(self, target: FrozenTarget) -> None:
        self.target = target

    def propose(self, seq: list[int], hidden3: torch.Tensor, k: int) -> list[int]:
        out: list[int] = []
        for _ in range(k):
            logits, _h = self.target.logits_and_hidden3(torch.tensor([seq + out]), eager=True)
            out.append(int(logits[0, -1].argmax()))
        return out


def fp8_forward(target: FrozenTarget) -> Any:
    """What the evaluation ran before: the FP8 forward itself verifying the drafts."""

    def forward(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden3 = target.logits_and_hidden3(torch.tensor([ids]), eager=True)
        return logits[0], hidden3

    return forward


def test_the_evaluation_of_an_fp8_target_verifies_with_the_exact_target_and_does_not_overstate_tau() -> None:
    exact, fp8 = tiny(fp8=False), tiny(fp8=True, keep_exact=True)
    prompts = heldout_prompts(exact.tokenizer, "shipped", holdout=32, seed=0, count=2)
    oracle = Fp8Oracle(fp8)
    outs_kept: list[list[int]] = []
    outs_exact: list[list[int]] = []
    outs_fp8: list[list[int]] = []
    kept = evaluate(target_forward(fp8), oracle, prompts, k=K, max_new_tokens=MAX_NEW, eos_id=None, outputs=outs_kept)
    ref = evaluate(target_forward(exact), oracle, prompts, k=K, max_new_tokens=MAX_NEW, eos_id=None, outputs=outs_exact)
    own = evaluate(fp8_forward(fp8), oracle, prompts, k=K, max_new_tokens=MAX_NEW, eos_id=None, outputs=outs_fp8)
    # The same text and counts as the unquantised target: the exact target decodes and verifies.
    assert outs_kept == outs_exact and kept.hist == ref.hist
    # Verified by the FP8 forward it learned, the drafter would score a perfect τ and the text would be the FP8's.
    assert own.tau == K + 1 and kept.tau < K + 1 and outs_fp8 != outs_exact


def run_config(tmp_path: Path, **overrides: Any) -> TrainerConfig:
    corpus = tmp_path / "small.jsonl"  # tokenizing the whole shipped corpus would be most of the test's time
    corpus.write_text("\n".join(shipped_corpus_path().read_text(encoding="utf-8").splitlines()[:64]) + "\n")
    return from_dict(
        {
            "target": "tiny",
            "tiny_layers": 4,
            "target_fp8": True,
            "data": str(corpus),
            "buckets": [128],
            "batch_size": 1,
            "ttt_steps": 2,
            "draft_vocab_size": 96,
            "steps": 2,
            "output_dir": str(tmp_path / "out"),
            "torch_threads": 1,
            **overrides,
        }
    )


def built_run(cfg: TrainerConfig) -> tuple[Any, list[dict[str, Any]], io.StringIO]:
    from engine.trainer.run.loop import TrainingRun

    stdout = io.StringIO()
    events = EventLog(Path(cfg.output_dir) / "events.jsonl", stdout=stdout)
    seen: list[dict[str, Any]] = []
    events.listeners.append(seen.append)
    engine = TrainingRun(cfg, events)
    engine.build()
    return engine, seen, stdout


def test_an_fp8_run_reports_its_agreement_with_the_exact_target_warns_below_the_threshold_and_evaluates_exactly(
    tmp_path: Path,
) -> None:
    cfg = run_config(
        tmp_path,
        fp8_check_batches=2,
        fp8_min_top1=1.0,
        eval_every=2,
        eval_k=K,
        eval_conversations=1,
        eval_max_new_tokens=8,
    )
    engine, seen, stdout = built_run(cfg)
    stages = [e for e in seen if e["kind"] == "stage" and e["stage"] == "fp8_agreement"]
    assert len(stages) == 1
    detail = stages[0]["detail"]
    assert "FP8 target vs exact on the loss-masked positions of the first 2 training batches" in detail
    assert "below fp8_min_top1 = 1.0" in detail
    top1 = float(re.search(r"top-1 agreement ([0-9.]+)", detail).group(1))  # type: ignore[union-attr]
    kl = float(re.search(r"KL\(target_p\) ([0-9.e+-]+) nats", detail).group(1))  # type: ignore[union-attr]
    # Exactly the trained positions of the batches the run trains first (assistant tokens; no prompt, no padding).
    masked = sum(int(engine.source.batch(i).loss_mask.sum()) for i in range(2))
    assert f"over {masked} positions" in detail and 0 < masked < 2 * 128

    # The same figures from a separately loaded exact target against an FP8 copy, on those positions.
    exact, fp8 = tiny(fp8=False), tiny(fp8=True)
    assert engine.vocab is not None
    batches = check_batches(engine.source, 2, torch.device("cpu"))
    vocab = engine.vocab
    offline = compare_forwards(
        exact.logits_and_hidden3, fp8.logits_and_hidden3, batches, vocab.draft_to_target, vocab.t2d(exact.vocab_size)
    )
    assert 0.5 < offline.top1_agree < 1.0 and top1 == pytest.approx(offline.top1_agree, abs=1e-4)
    assert kl > 0 and kl == pytest.approx(offline.kl_target_p, rel=0.01)
    lines = stdout.getvalue()
    assert "stage=fp8_agreement FP8 target vs exact" in lines
    assert f"warning: the FP8 target agrees with the exact one on {offline.top1_agree:.2%} of top-1 tokens" in lines
    assert "exact target weights kept for the evaluation" in lines and exact_bytes(engine.targets[0].model) > 0

    assert engine.run() == 0
    evals = [e for e in seen if e["kind"] == "eval"]
    assert [(e["step"], e.get("error")) for e in evals] == [(2, None)]
    # The drafter as evaluated at its last step, now against the unquantised target: the same counts.
    drafter = engine.workers[0].training.drafter
    prompts = heldout_prompts(exact.tokenizer, cfg.data, cfg.eval_holdout, cfg.seed, 1)
    again = evaluate(
        target_forward(exact),
        DrafterProposer(drafter, rope_offset=True),
        prompts,
        k=K,
        max_new_tokens=8,
        eos_id=getattr(exact.tokenizer, "eos_token_id", None),
    )
    assert evals[0]["accepted_hist"] == again.hist


def test_an_fp8_run_without_evaluation_releases_the_exact_weights_after_the_check(tmp_path: Path) -> None:
    engine, seen, stdout = built_run(run_config(tmp_path, fp8_check_batches=1, fp8_min_top1=0.0))
    assert [e["stage"] for e in seen if e["kind"] == "stage" and e["stage"] == "fp8_agreement"] == ["fp8_agreement"]
    assert "warning: the FP8 target" not in stdout.getvalue()
    assert "exact target weights released after the check" in stdout.getvalue()
    assert exact_bytes(engine.targets[0].model) == 0


def test_an_fp8_run_with_no_check_and_no_evaluation_never_keeps_the_exact_weights(tmp_path: Path) -> None:
    engine, seen, stdout = built_run(run_config(tmp_path, fp8_check_batches=0))
    assert not [e for e in seen if e["kind"] == "stage" and e["stage"] == "fp8_agreement"]
    assert "exact target weights" not in stdout.getvalue() and exact_bytes(engine.targets[0].model) == 0


EVERY = 20  # the perturbed target's top token differs from the exact one's at every EVERY-th chosen position


@pytest.mark.parametrize("where, warns", [("trained", True), ("untrained", False)])
def test_the_agreement_counts_the_first_training_batches_trained_positions_and_warns_below_098(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, warns: bool
) -> None:
    """A stand-in FP8 forward: the exact target, its top token moved at every 20th loss-masked position of the run's
    training batches (a 0.95 agreement there) or at every 20th position outside them. Only the first warns, at
    the default fp8_min_top1 (0.98)."""
    from engine.trainer.run.loop import TrainingRun

    cfg = run_config(tmp_path, fp8_check_batches=2)
    assert cfg.fp8_min_top1 == 0.98
    stdout = io.StringIO()
    events = EventLog(Path(cfg.output_dir) / "events.jsonl", stdout=stdout)
    seen: list[dict[str, Any]] = []
    events.listeners.append(seen.append)
    engine = TrainingRun(cfg, events)
    exact_forward = FrozenTarget.logits_and_hidden3
    moved: list[int] = []

    def perturbed(self: FrozenTarget, input_ids: torch.Tensor, **kw: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden3 = exact_forward(self, input_ids, **{**kw, "exact": True})
        if kw.get("exact") or engine.source is None:
            return logits, hidden3
        for i in range(cfg.fp8_check_batches):
            hb = engine.source.batch(i)
            if torch.equal(hb.input_ids, input_ids):
                trained = hb.loss_mask > 0
                chosen = (trained if where == "trained" else ~trained).nonzero()[::EVERY]
                logits = logits.clone()
                for b, t in chosen.tolist():
                    logits[b, t, logits[b, t].argmax()] = logits[b, t].min() - 1.0
                moved.append(len(chosen))
        return logits, hidden3

    monkeypatch.setattr(FrozenTarget, "logits_and_hidden3", perturbed)
    engine.build()
    (stage,) = [e for e in seen if e["kind"] == "stage" and e["stage"] == "fp8_agreement"]
    masked = sum(int(engine.source.batch(i).loss_mask.sum()) for i in range(2))
    top1 = float(re.search(r"top-1 agreement ([0-9.]+)", stage["detail"]).group(1))  # type: ignore[union-attr]
    assert len(moved) == 2  # both training batches went through the check
    assert top1 == pytest.approx(1 - sum(moved) / masked if warns else 1.0, abs=1e-4)
    warning = "warning: the FP8 target agrees with the exact one on"
    assert (warning in stdout.getvalue()) is warns
    assert ("below fp8_min_top1 = 0.98" in stage["detail"]) is warns
