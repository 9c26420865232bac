"""Soft cross-entropy, acc_i and the 0.8^i weighting against numbers worked out by hand."""

from __future__ import annotations

import math

import torch

from engine.trainer.draft.loss import (
    accuracies,
    loss_function,
    soft_cross_entropy,
    soft_cross_entropy_masked_mean,
    total_loss,
)

# Two positions, three draft tokens. softmax of [0, ln2, ln3] = [1/6, 2/6, 3/6].
LOGITS = torch.tensor([[[0.0, math.log(2.0), math.log(3.0)], [5.0, 0.0, 0.0]]])
TARGET_P = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]]])
FIRST_CE = -(0.5 * math.log(1 / 6) + 0.25 * math.log(2 / 6) + 0.25 * math.log(3 / 6))
SECOND_CE = -math.log(1 / (math.exp(5.0) + 2))


def test_loss_is_specforges_mean_over_every_position_masked_ones_counting_zero() -> None:
    mask = torch.tensor([[1.0, 0.0]])  # the second position is masked out
    loss, correct, count = soft_cross_entropy(LOGITS, TARGET_P, mask)
    assert math.isclose(float(loss), FIRST_CE / 2, rel_tol=1e-6)  # / (B*T) = / 2, not / (masked count) = / 1
    assert float(correct) == 0.0  # argmax logits = 2, argmax target = 0
    assert float(count) == 1.0
    loss2, correct2, count2 = soft_cross_entropy(LOGITS, TARGET_P, torch.ones(1, 2))
    assert math.isclose(float(loss2), (FIRST_CE + SECOND_CE) / 2, rel_tol=1e-6)
    assert (float(correct2), float(count2)) == (0.0, 2.0)
    target_hit = torch.tensor([[[0.1, 0.2, 0.7], [0.0, 1.0, 0.0]]])  # agrees with the logits at position 0
    _, correct3, _ = soft_cross_entropy(LOGITS, target_hit, mask)
    assert float(correct3) == 1.0


def test_masked_mean_divides_by_the_masked_positions_only() -> None:
    mask = torch.tensor([[1.0, 0.0]])
    loss, _, _ = soft_cross_entropy_masked_mean(LOGITS, TARGET_P, mask)
    assert math.isclose(float(loss), FIRST_CE, rel_tol=1e-6)
    assert loss_function("masked_positions") is soft_cross_entropy_masked_mean
    assert loss_function("all_positions") is soft_cross_entropy


def test_accuracy_denominator_is_the_loss_mask_so_out_of_vocab_targets_count_as_misses() -> None:
    # Both positions are in the data's loss mask; the second one's target token is outside the draft
    # vocabulary, so it is not trained on (position mask 0) but still counts in acc's denominator.
    target_hit = torch.tensor([[[0.1, 0.2, 0.7], [1.0, 0.0, 0.0]]])
    position_mask = torch.tensor([[1.0, 0.0]])
    loss_mask = torch.ones(1, 2)
    _, correct, count = soft_cross_entropy(LOGITS, target_hit, position_mask, loss_mask)
    assert (float(correct), float(count)) == (1.0, 2.0)  # acc = 0.5, not 1/1
    _, _, count_without = soft_cross_entropy(LOGITS, target_hit, position_mask)
    assert float(count_without) == 1.0


def test_total_loss_weights_steps_by_point_eight_to_the_i() -> None:
    losses = torch.tensor([1.0, 2.0, 4.0])
    assert math.isclose(float(total_loss(losses)), 1.0 + 0.8 * 2.0 + 0.64 * 4.0, rel_tol=1e-6)
    acc = accuracies(torch.tensor([3.0, 0.0]), torch.tensor([4.0, 0.0]))
    assert acc.tolist() == [0.75, 0.0]


def test_one_pass_loss_and_gradient_equal_log_softmax_then_weighted_sum() -> None:
    # The loss is computed as lse(z) * sum p - sum p*z; against -sum p * log_softmax(z) on random rows, with
    # zero rows (the shifted tail) and a masked position. The reference is float64; the loss computes in float32
    # (as on the GPU, from bf16 logits), so both agree to float32 rounding: 1e-6 relative.
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 11, generator=g, dtype=torch.float64) * 3).requires_grad_(True)
    target_p = torch.softmax(torch.randn(2, 5, 11, generator=g, dtype=torch.float64), dim=-1)
    target_p[:, -2:] = 0.0  # shifted past the end of the row
    mask = torch.ones(2, 5, dtype=torch.float64)
    mask[0, 1] = 0.0
    for fn in (soft_cross_entropy, soft_cross_entropy_masked_mean):
        loss, _, _ = fn(logits, target_p, mask)
        (grad,) = torch.autograd.grad(loss, logits)
        denominator = mask.numel() if fn is soft_cross_entropy else float(mask.sum())
        ref = (-(target_p * torch.log_softmax(logits, dim=-1)).sum(-1) * mask).sum() / denominator
        (ref_grad,) = torch.autograd.grad(ref, logits)
        assert abs(float(loss) - float(ref)) <= 1e-6 * abs(float(ref))
        assert float((grad - ref_grad).abs().max()) <= 1e-6 * float(ref_grad.abs().max())
