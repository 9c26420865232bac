"""Soft cross-entropy, acc_i and the 0.8^i weighting against numbers worked out by hand."""

from __future__ import annotations

import math

import torch

from engine.trainer.draft.loss import (
    accuracies,
    loss_function,
    soft_cross_entropy,
    soft_cross_entropy_masked_mean,
    target_probabilities,
    total_loss,
)
from engine.trainer.draft.model import shift_left

# Two positions, three draft tokens. softmax of [0, ln2, ln3] = [1/6, 2/6, 3/6].
LOGITS = torch.tensor([[[0.0, math.log(2.0), math.log(3.0)], [5.0, 0.0, 0.0]]])
TARGET_P = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]]])
FIRST_CE = -(0.5 * math.log(1 / 6) + 0.25 * math.log(2 / 6) + 0.25 * math.log(3 / 6))
SECOND_CE = -math.log(1 / (math.exp(5.0) + 2))


def target(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A distribution ``p`` as the loss takes the target: logits (log p; -inf where p = 0) and their lse (0)."""
    return p.log(), torch.zeros(p.shape[:-1], dtype=p.dtype)


def test_loss_is_specforges_mean_over_every_position_masked_ones_counting_zero() -> None:
    mask = torch.tensor([[1.0, 0.0]])  # the second position is masked out
    loss, correct, count = soft_cross_entropy(LOGITS, *target(TARGET_P), mask)
    assert math.isclose(float(loss), FIRST_CE / 2, rel_tol=1e-6)  # / (B*T) = / 2, not / (masked count) = / 1
    assert float(correct) == 0.0  # argmax logits = 2, argmax target = 0
    assert float(count) == 1.0
    loss2, correct2, count2 = soft_cross_entropy(LOGITS, *target(TARGET_P), torch.ones(1, 2))
    assert math.isclose(float(loss2), (FIRST_CE + SECOND_CE) / 2, rel_tol=1e-6)
    assert (float(correct2), float(count2)) == (0.0, 2.0)
    target_hit = torch.tensor([[[0.1, 0.2, 0.7], [0.0, 1.0, 0.0]]])  # agrees with the logits at position 0
    _, correct3, _ = soft_cross_entropy(LOGITS, *target(target_hit), mask)
    assert float(correct3) == 1.0


def test_masked_mean_divides_by_the_masked_positions_only() -> None:
    mask = torch.tensor([[1.0, 0.0]])
    loss, _, _ = soft_cross_entropy_masked_mean(LOGITS, *target(TARGET_P), mask)
    assert math.isclose(float(loss), FIRST_CE, rel_tol=1e-6)
    assert loss_function("masked_positions") is soft_cross_entropy_masked_mean
    assert loss_function("all_positions") is soft_cross_entropy


def test_accuracy_denominator_is_the_loss_mask_so_out_of_vocab_targets_count_as_misses() -> None:
    # Both positions are in the data's loss mask; the second one's target token is outside the draft
    # vocabulary, so it is not trained on (position mask 0) but still counts in acc's denominator.
    target_hit = torch.tensor([[[0.1, 0.2, 0.7], [1.0, 0.0, 0.0]]])
    position_mask = torch.tensor([[1.0, 0.0]])
    loss_mask = torch.ones(1, 2)
    _, correct, count = soft_cross_entropy(LOGITS, *target(target_hit), position_mask, loss_mask)
    assert (float(correct), float(count)) == (1.0, 2.0)  # acc = 0.5, not 1/1
    _, _, count_without = soft_cross_entropy(LOGITS, *target(target_hit), position_mask)
    assert float(count_without) == 1.0


def test_total_loss_weights_steps_by_point_eight_to_the_i() -> None:
    losses = torch.tensor([1.0, 2.0, 4.0])
    assert math.isclose(float(total_loss(losses)), 1.0 + 0.8 * 2.0 + 0.64 * 4.0, rel_tol=1e-6)
    acc = accuracies(torch.tensor([3.0, 0.0]), torch.tensor([4.0, 0.0]))
    assert acc.tolist() == [0.75, 0.0]


def test_one_pass_loss_and_gradient_equal_log_softmax_then_weighted_sum() -> None:
    # The loss is computed as lse(z) * sum p - sum p*z with p = exp(z_t - lse_t) from the target's logits; against
    # -sum softmax(z_t) * log_softmax(z) on random rows, with the shifted tail (logits 0, lse +inf: p = 0, as
    # ttt_step shifts them) and a masked position. The reference is float64; the loss computes in float32 (as on
    # the GPU, from bf16 logits), so both agree to float32 rounding: 1e-6 relative.
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    target_z = torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 2
    z_t, lse_t = shift_left(target_z, 2), shift_left(torch.logsumexp(target_z, dim=-1), 2, float("inf"))
    target_p = torch.cat((torch.softmax(target_z, dim=-1)[:, 2:], torch.zeros(2, 2, 11, dtype=torch.float64)), 1)
    assert torch.equal(target_probabilities(z_t, lse_t)[:, -2:], torch.zeros(2, 2, 11, dtype=torch.float32))
    torch.testing.assert_close(target_probabilities(z_t, lse_t).double(), target_p, rtol=1e-6, atol=1e-7)
    mask = torch.ones(2, 5, dtype=torch.float64)
    mask[0, 1] = 0.0
    for fn in (soft_cross_entropy, soft_cross_entropy_masked_mean):
        loss, correct, _ = fn(logits, z_t, lse_t, mask)
        (grad,) = torch.autograd.grad(loss, logits)
        denominator = mask.numel() if fn is soft_cross_entropy else float(mask.sum())
        ref = (-(target_p * torch.log_softmax(logits, dim=-1)).sum(-1) * mask).sum() / denominator
        (ref_grad,) = torch.autograd.grad(ref, logits)
        assert abs(float(loss) - float(ref)) <= 1e-6 * abs(float(ref))
        assert float((grad - ref_grad).abs().max()) <= 1e-6 * float(ref_grad.abs().max())
        hits = (logits.argmax(-1) == target_p.argmax(-1)).double() * mask
        assert float(correct) == float(hits.sum())
