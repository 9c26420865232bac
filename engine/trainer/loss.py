"""EAGLE-3's loss: soft cross-entropy against the target's distribution on the draft vocabulary.

Per TTT step ``i``: ``loss_i = -sum_t m_t * sum_v p_tv * log softmax(z_t)_v / max(1, sum_t m_t)`` and
``acc_i = #{t : m_t and argmax z_t == argmax p_t} / sum_t m_t``. The total is ``sum_i 0.8**i * loss_i``.
"""

from __future__ import annotations

import torch

from engine.trainer.metrics import STEP_WEIGHT_DECAY


def soft_cross_entropy(
    logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (mean loss over masked positions, correct top-1 count, masked position count)."""
    m = mask.to(torch.float32)
    logp = torch.log_softmax(logits.float(), dim=-1)
    per_position = -(target_p.float() * logp).sum(dim=-1)
    count = m.sum()
    loss = (per_position * m).sum() / count.clamp_min(1.0)
    hits = (logits.argmax(dim=-1) == target_p.argmax(dim=-1)).to(torch.float32) * m
    return loss, hits.sum(), count


def step_weights(ttt_steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return STEP_WEIGHT_DECAY ** torch.arange(ttt_steps, dtype=torch.float32, device=device)


def total_loss(losses: torch.Tensor) -> torch.Tensor:
    return (losses * step_weights(losses.numel(), losses.device)).sum()


def accuracies(correct: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return correct / counts.clamp_min(1.0)
