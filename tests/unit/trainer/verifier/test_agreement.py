"""The FP8 agreement check (verifier/agreement.py) holds one forward's logits at a time, not two per batch, and
gives the figures the whole tensors give."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

from engine.trainer.verifier import agreement
from engine.trainer.verifier.agreement import CheckBatch, compare_forwards, probabilities
from engine.trainer.verifier.model import training_targets

B, T, V, H3 = 2, 24, 40, 12
DRAFT_IDS = torch.arange(0, V, 2)  # the even ids
T2D = torch.arange(V) % 2 == 0


def forward_of(seed: int, noise: float) -> Any:
    """A stand-in target: logits and hidden states fixed by the ids, moved by ``noise`` for the approximate one."""

    def forward(ids: torch.Tensor, documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(int(ids.sum()))
        logits, hidden = torch.randn(B, T, V, generator=g) * 3, torch.randn(B, T, H3, generator=g)
        n = torch.Generator().manual_seed(seed + int(ids.sum()))
        return logits + noise * torch.randn(B, T, V, generator=n), hidden + noise * torch.randn(B, T, H3, generator=n)

    return forward


def batches() -> list[CheckBatch]:
    g = torch.Generator().manual_seed(5)
    return [
        CheckBatch(torch.randint(0, V, (B, T), generator=g), (torch.rand(B, T, generator=g) > 0.4).float())
        for _ in range(3)
    ]


def reference(exact: Any, approx: Any, checks: list[CheckBatch]) -> dict[str, float]:
    """The figures from the whole (B, T, V) tensors of both forwards at once."""
    top1 = mask = kl = tv = h_num = h_den = n = 0.0
    for batch in checks:
        (la, ha), (lb, hb) = exact(batch.input_ids), approx(batch.input_ids)
        keep = batch.loss_mask > 0
        la, lb, ha, hb = la[keep][None], lb[keep][None], ha[keep].double(), hb[keep].double()
        ones = torch.ones(la.shape[:2])
        (za, sa, ma), (zb, sb, mb) = (
            training_targets(la, ones, DRAFT_IDS, T2D),
            training_targets(lb, ones, DRAFT_IDS, T2D),
        )
        pa, pb = probabilities(za, sa), probabilities(zb, sb)
        top1 += float((la.argmax(-1) == lb.argmax(-1)).sum())
        mask += float((ma == mb).sum())
        kl += float((pa * (pa.clamp_min(1e-30).log() - pb.clamp_min(1e-30).log())).sum())
        tv += float(0.5 * (pa - pb).abs().sum())
        h_num, h_den, n = h_num + float((hb - ha).pow(2).sum()), h_den + float(ha.pow(2).sum()), n + float(keep.sum())
    return {"positions": n, "top1_agree": top1 / n, "mask_agree": mask / n, "kl_target_p": kl / n,
            "tv_target_p": tv / n, "hidden_rel_err": (h_num / h_den) ** 0.5}  # fmt: skip


def test_the_exact_forwards_logits_are_gone_before_the_approximate_forward_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exact, approx = forward_of(1, 0.0), forward_of(2, 0.3)
    alive: list[weakref.ref[torch.Tensor]] = []
    held_while_approx_ran: list[bool] = []

    def tracked_exact(ids: torch.Tensor, documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = exact(ids)
        alive.append(weakref.ref(logits))
        return logits, hidden

    def checked_approx(ids: torch.Tensor, documents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        gc.collect()
        held_while_approx_ran.append(any(ref() is not None for ref in alive))
        return approx(ids)

    monkeypatch.setattr(agreement, "CHUNK_POSITIONS", 7)  # several chunks a batch
    checks = batches()
    got = compare_forwards(tracked_exact, checked_approx, checks, DRAFT_IDS, T2D)
    assert held_while_approx_ran == [False, False, False]  # one (B, T, V) logits tensor at a time, not two
    want = reference(exact, approx, checks)
    assert got.positions == want["positions"]
    for key in ("top1_agree", "mask_agree", "kl_target_p", "tv_target_p", "hidden_rel_err"):
        assert getattr(got, key) == pytest.approx(want[key], rel=1e-9), key
    assert 0 < got.top1_agree < 1 and got.kl_target_p > 0
