"""The FP8 target at the start of a run (``target_fp8 = true``): how far it is from the exact one, and what it keeps.

Before the first step the run measures the FP8 target against its own exact weights (verifier/agreement.py) on the
loss-masked positions of its first ``fp8_check_batches`` training batches (the tokens the drafter is trained on,
packed rows kept apart as in training), reports the figures as an ``fp8_agreement`` stage and a log line, and warns
when top-1 agreement is below ``fp8_min_top1``: the drafter would learn from targets the served model does not
produce. The exact weights stay only while something needs them: the check, and the evaluation during training
(``eval_every``), which measures τ against the exact target.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from engine.trainer.config import TrainerConfig
from engine.trainer.data.sources import BatchSource
from engine.trainer.data.vocab import DraftVocab
from engine.trainer.verifier.agreement import Agreement, CheckBatch, compare_forwards
from engine.trainer.verifier.fp8 import exact_bytes, release_exact
from engine.trainer.verifier.model import FrozenTarget

STAGE = "fp8_agreement"


def size_text(n_bytes: int) -> str:
    return f"{n_bytes / 1e9:.2f} GB" if n_bytes >= 100e6 else f"{n_bytes / 1e6:.2f} MB"


def keeps_exact_weights(cfg: TrainerConfig) -> bool:
    """Whether the FP8 target must keep its exact weights: for the check at the start, or to evaluate τ."""
    return cfg.target_fp8 and (cfg.fp8_check_batches > 0 or cfg.eval_every > 0)


def check_batches(source: BatchSource, n: int, device: torch.device) -> Iterator[CheckBatch]:
    """The first ``n`` training batches, on ``device`` one at a time, with their loss masks (and packed rows'
    documents)."""
    for index in range(n):
        hb = source.batch(index)
        docs = hb.documents.to(device) if hb.documents is not None else None
        yield CheckBatch(hb.input_ids.to(device), hb.loss_mask.to(device), docs)


def measure_fp8_target(
    cfg: TrainerConfig, target: FrozenTarget, vocab: DraftVocab, source: BatchSource
) -> tuple[Agreement, str]:
    """The FP8 target against its exact weights on the first training batches, and which those were."""
    batches = check_batches(source, cfg.fp8_check_batches, target.device)
    draft_ids = vocab.draft_to_target.to(target.device)
    t2d = vocab.t2d(target.vocab_size).to(target.device)

    def exact(ids: torch.Tensor, documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return target.logits_and_hidden3(ids, exact=True, documents=documents)

    def fp8(ids: torch.Tensor, documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return target.logits_and_hidden3(ids, eager=True, documents=documents)  # the check compiles nothing

    agreement = compare_forwards(exact, fp8, batches, draft_ids, t2d)
    return agreement, f"the loss-masked positions of the first {cfg.fp8_check_batches} training batches"


def check_fp8_targets(
    cfg: TrainerConfig, targets: list[FrozenTarget], vocab: DraftVocab, source: BatchSource, events: Any
) -> None:
    """The start of an FP8 run: the agreement stage (and a warning below ``fp8_min_top1``), then the exact weights
    released where no evaluation needs them. Every target is a copy of the first: the first is measured."""
    if not cfg.target_fp8 or not targets:
        return
    kept = sum(exact_bytes(t.model) for t in targets)
    if cfg.fp8_check_batches > 0:
        agreement, where = measure_fp8_target(cfg, targets[0], vocab, source)
        low = agreement.top1_agree < cfg.fp8_min_top1
        events.stage(
            STAGE,
            f"FP8 target vs exact on {where}: {agreement.describe()}"
            f"{f' (below fp8_min_top1 = {cfg.fp8_min_top1})' if low else ''}",
        )
        if low:
            events.say(
                f"warning: the FP8 target agrees with the exact one on {agreement.top1_agree:.2%} of top-1 tokens, "
                f"below fp8_min_top1 = {cfg.fp8_min_top1}: the drafter trains on targets a bf16 server does not "
                f"produce (target_fp8 = false trains on the exact target)"
            )
    if cfg.eval_every > 0:
        events.say(f"fp8: exact target weights kept for the evaluation: {size_text(kept)} beside the e4m3 ones")
    elif kept:
        freed = sum(release_exact(t.model) for t in targets)
        events.say(f"fp8: exact target weights released after the check: {size_text(freed)}")
