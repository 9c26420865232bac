"""Soft cross-entropy, acc_i and the 0.8^i weighting against numbers worked out by hand."""

from __future__ import annotations

import math

import torch

from engine.trainer.loss import accuracies, soft_cross_entropy, total_loss


def test_loss_and_acc_equal_a_hand_computed_tiny_case() -> None:
    # Two positions, three draft tokens; the second position is masked out.
    logits = torch.tensor([[[0.0, math.log(2.0), math.log(3.0)], [5.0, 0.0, 0.0]]])
    target_p = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 1.0, 0.0]]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, correct, count = soft_cross_entropy(logits, target_p, mask)
    # softmax of [0, ln2, ln3] = [1/6, 2/6, 3/6]
    expected = -(0.5 * math.log(1 / 6) + 0.25 * math.log(2 / 6) + 0.25 * math.log(3 / 6))
    assert math.isclose(float(loss), expected, rel_tol=1e-6)
    assert float(correct) == 0.0  # argmax logits = 2, argmax target = 0
    assert float(count) == 1.0
    # Unmask the second position: argmax 0 vs 1 -> still wrong; loss = mean of both.
    loss2, correct2, count2 = soft_cross_entropy(logits, target_p, torch.ones(1, 2))
    second = -math.log(1 / (math.exp(5.0) + 2))
    assert math.isclose(float(loss2), (expected + second) / 2, rel_tol=1e-6)
    assert (float(correct2), float(count2)) == (0.0, 2.0)
    # A hit: make the target agree with the logits' argmax at position 0.
    target_hit = torch.tensor([[[0.1, 0.2, 0.7], [0.0, 1.0, 0.0]]])
    _, correct3, _ = soft_cross_entropy(logits, target_hit, mask)
    assert float(correct3) == 1.0


def test_total_loss_weights_steps_by_point_eight_to_the_i() -> None:
    losses = torch.tensor([1.0, 2.0, 4.0])
    assert math.isclose(float(total_loss(losses)), 1.0 + 0.8 * 2.0 + 0.64 * 4.0, rel_tol=1e-6)
    acc = accuracies(torch.tensor([3.0, 0.0]), torch.tensor([4.0, 0.0]))
    assert acc.tolist() == [0.75, 0.0]
