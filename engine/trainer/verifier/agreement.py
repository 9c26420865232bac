"""How far an approximate target (the FP8 one, fp8.py) moves what the drafter trains on, against the exact target.

The same token batches go through both forwards; over the positions the drafter trains on (each batch's loss mask,
every position where a batch has none):

  top1_agree       share of positions whose full-vocabulary argmax is the same (it sets the position mask)
  mask_agree       share of positions whose position mask (top token in the draft vocabulary) is the same
  kl_target_p      mean KL(p_exact || p_approx) of the draft-vocabulary distributions (nats per position)
  tv_target_p      mean total-variation distance of the same distributions
  hidden_rel_err   ||h_approx - h_exact|| / ||h_exact|| of the three captured layers (the drafter's input)

An FP8 run measures it at its start on the loss-masked positions of its first training batches (run/fp8_check.py,
the ``fp8_agreement`` stage); ``tests/bench/bench_fp8_target.py`` measures it offline, with forward times.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.trainer.verifier.model import training_targets

# (ids (B, T), documents=(B, T) packed rows' conversation numbers or None) -> (logits (B, T, V), hidden3 (B, T, 3H))
Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
PROB_FLOOR = 1e-30  # log(0) of a probability that underflowed: a large finite KL term instead of inf or nan
CHUNK_POSITIONS = 1024  # positions compared at once (their logits rows, float64 (n, Vd) distributions)


@dataclass(frozen=True)
class CheckBatch:
    """A batch both forwards run: its ids, the positions measured (its loss mask; None: all) and, for packed rows,
    their conversation numbers (each forward then keeps the conversations apart, as training does)."""

    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor | None = None  # (B, T)
    documents: torch.Tensor | None = None  # (B, T)


@dataclass(frozen=True)
class Agreement:
    positions: int
    top1_agree: float
    mask_agree: float
    kl_target_p: float
    tv_target_p: float
    hidden_rel_err: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"top-1 agreement {self.top1_agree:.4f}, KL(target_p) {self.kl_target_p:.2e} nats, "
            f"TV {self.tv_target_p:.4f}, mask agreement {self.mask_agree:.4f}, "
            f"hidden error {self.hidden_rel_err:.4f} over {self.positions} positions"
        )


@dataclass(frozen=True)
class _Kept:
    """What the comparison reads of one forward at up to CHUNK_POSITIONS measured positions."""

    top: torch.Tensor  # (n,) the full-vocabulary argmax
    draft_logits: torch.Tensor  # (n, Vd) in the logits' dtype
    lse: torch.Tensor  # (n,) float32: their log-sum-exp
    mask: torch.Tensor  # (n,) the position mask (top token in the draft vocabulary)
    hidden: torch.Tensor  # (n, 3H)


def _measured(
    logits: torch.Tensor, hidden3: torch.Tensor, keep: torch.Tensor, draft_ids: torch.Tensor, t2d: torch.Tensor
) -> Iterator[_Kept]:
    """One forward's figures at the ``keep`` positions, CHUNK_POSITIONS rows of its ``(B, T, V)`` logits at a time:
    no copy of the whole."""
    flat, hidden = logits.reshape(-1, logits.shape[-1]), hidden3.reshape(-1, hidden3.shape[-1])
    rows = keep.reshape(-1).nonzero().squeeze(1)
    for lo in range(0, rows.numel(), CHUNK_POSITIONS):
        at = rows[lo : lo + CHUNK_POSITIONS]
        part = flat.index_select(0, at)
        z, lse, mask = training_targets(part[None], torch.ones(1, at.numel(), device=part.device), draft_ids, t2d)
        yield _Kept(part.argmax(-1), z[0], lse[0], mask[0], hidden.index_select(0, at))


@torch.no_grad()
def compare_forwards(
    exact: Forward,
    approx: Forward,
    batches: Iterable[CheckBatch],  # on the forwards' device
    draft_ids: torch.Tensor,  # (Vd,) long: the target id of each draft token
    t2d: torch.Tensor,  # (V,) bool: the target ids in the draft vocabulary
) -> Agreement:
    """``approx`` measured against ``exact`` on the loss-masked positions of ``batches`` (see the module
    docstring), batch by batch: of the exact forward only its draft-vocabulary logits at those positions are kept
    while the approximate one runs, and no forward's logits outlive their batch."""
    top1 = mask = kl = tv = h_num = h_den = 0.0
    n = 0
    for batch in batches:
        ids = batch.input_ids
        keep = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
        if batch.loss_mask is not None:
            keep = batch.loss_mask.to(ids.device) > 0
        kept = list(_measured(*exact(ids, documents=batch.documents), keep, draft_ids, t2d))
        for a, b in zip(kept, _measured(*approx(ids, documents=batch.documents), keep, draft_ids, t2d), strict=True):
            top1 += (a.top == b.top).double().sum().item()
            mask += (a.mask == b.mask).double().sum().item()
            h_num += (b.hidden.double() - a.hidden.double()).pow(2).sum().item()
            h_den += a.hidden.double().pow(2).sum().item()
            pa, pb = probabilities(a.draft_logits, a.lse), probabilities(b.draft_logits, b.lse)
            kl += (pa * (pa.clamp_min(PROB_FLOOR).log() - pb.clamp_min(PROB_FLOOR).log())).sum(-1).sum().item()
            tv += (0.5 * (pa - pb).abs().sum(-1)).sum().item()
        n += int(keep.sum().item())
    if n == 0:
        raise ValueError("no positions to compare the targets on")
    return Agreement(
        positions=n,
        top1_agree=top1 / n,
        mask_agree=mask / n,
        kl_target_p=kl / n,
        tv_target_p=tv / n,
        hidden_rel_err=(h_num / h_den) ** 0.5 if h_den else float("nan"),
    )


def probabilities(draft_logits: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The target's distribution over the draft vocabulary, as the loss makes it (``exp(z - lse)``), in float64."""
    return torch.exp(draft_logits.double() - lse.double().unsqueeze(-1))
