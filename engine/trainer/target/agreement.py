"""How far an approximate target (the FP8 one, fp8.py) moves what the drafter trains on, against the exact target.

The same token batches go through both forwards; over every position:

  top1_agree       share of positions whose full-vocabulary argmax is the same (it sets the position mask)
  mask_agree       share of positions whose position mask (top token in the draft vocabulary) is the same
  kl_target_p      mean KL(p_exact || p_approx) of the draft-vocabulary distributions (nats per position)
  tv_target_p      mean total-variation distance of the same distributions
  hidden_rel_err   ||h_approx - h_exact|| / ||h_exact|| of the three captured layers (the drafter's input)

An FP8 run measures it at its start on held-out text (run/loop.py, the ``fp8_agreement`` stage);
``tests/bench/bench_fp8_target.py`` measures it offline, with forward times.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from engine.trainer.draft.loss import target_probabilities
from engine.trainer.target.model import training_targets

Forward = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # ids (B, T) -> (logits, hidden3)
PROB_FLOOR = 1e-30  # log(0) of a probability that underflowed: a large finite KL term instead of inf or nan


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


@torch.no_grad()
def compare_forwards(
    exact: Forward,
    approx: Forward,
    batches: Sequence[torch.Tensor],  # each (B, T) long, on the forwards' device
    draft_ids: torch.Tensor,  # (Vd,) long: the target id of each draft token
    t2d: torch.Tensor,  # (V,) bool: the target ids in the draft vocabulary
) -> Agreement:
    """``approx`` measured against ``exact`` on ``batches`` (every position counts; see the module docstring)."""
    top1 = mask = kl = tv = h_num = h_den = 0.0
    n = 0
    for ids in batches:
        ones = torch.ones(ids.shape, device=ids.device)
        lo_a, h_a = exact(ids)
        lo_b, h_b = approx(ids)
        za, lse_a, mask_a = training_targets(lo_a, ones, draft_ids, t2d)
        zb, lse_b, mask_b = training_targets(lo_b, ones, draft_ids, t2d)
        pa, pb = target_probabilities(za, lse_a).double(), target_probabilities(zb, lse_b).double()
        top1 += (lo_a.argmax(-1) == lo_b.argmax(-1)).double().sum().item()
        mask += (mask_a == mask_b).double().sum().item()
        kl += (pa * (pa.clamp_min(PROB_FLOOR).log() - pb.clamp_min(PROB_FLOOR).log())).sum(-1).sum().item()
        tv += (0.5 * (pa - pb).abs().sum(-1)).sum().item()
        h_num += (h_b.double() - h_a.double()).pow(2).sum().item()
        h_den += h_a.double().pow(2).sum().item()
        n += ids.numel()
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


def token_batches(
    prompts: Sequence[list[int]] | None, vocab_size: int, batch: int, seq: int, n: int, *, seed: int = 0
) -> list[torch.Tensor]:
    """``n`` batches of ``batch`` rows of ``seq`` tokens: each prompt repeated up to the length (real text at every
    position), or seeded random ids when there are no prompts (a random-weight target, random data)."""
    if not prompts:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab_size, (batch, seq), generator=g) for _ in range(n)]
    rows = [torch.tensor((p * (seq // max(1, len(p)) + 1))[:seq]) for p in prompts[: batch * n]]
    stacked = torch.stack(rows)
    return [b for b in (stacked[i * batch : (i + 1) * batch] for i in range(n)) if len(b)]
