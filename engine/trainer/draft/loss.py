"""EAGLE-3's loss: soft cross-entropy against the target's distribution on the draft vocabulary.

Per TTT step ``i``, over the ``B x T`` positions of a batch (``T`` the length bucket), with ``z`` the
drafter's logits, ``p`` the target's softmax over the draft vocabulary, ``m`` the position mask (the data's
loss mask and the target's top token in the draft vocabulary) and ``l`` the data's loss mask, all shifted
to step ``i``'s targets (the tail beyond the sequence counts as masked):

* ``loss_i = -sum_{b,t} m_bt * sum_v p_btv * log softmax(z_bt)_v / (B * T)`` by default
  (``loss_mean = "all_positions"``): SpecForge's ``_compute_loss``, a mean over every position, masked ones
  counting zero, so SpecForge's learning rates carry over. ``loss_mean = "masked_positions"`` divides by
  ``max(1, sum m)`` instead: the mean cross-entropy of the positions trained on.
* ``acc_i = #{(b,t) : m_bt and argmax z_bt == argmax p_bt} / sum_{b,t} l_bt``: top-1 agreement with the
  target over the loss-masked positions (SpecForge's ``acces``); a position whose target token is outside
  the draft vocabulary counts as a miss, as it would be rejected when served. Without ``l`` the
  denominator is ``sum m`` (only the positions trained on).

The target comes as its logits over the draft vocabulary, in the target's dtype (bf16 on a GPU: what its head
computed), with their float32 log-sum-exp ``lse_t``; ``p = exp(z_t - lse_t)`` is made inside the loss's fused
reductions and again in its backward. That is the float32 softmax of the same logits up to rounding (1e-6), from
half the bytes a float32 ``p`` takes: each TTT step reads the target twice (forward and backward), and this
saved 0.44 ms of a step's 2.33 ms forward and backward on an H100 (tests/bench/bench_kernels.py ``loss``). A
row with ``lse_t = +inf`` has ``p = 0`` (the shifted tail).

The total trained on is ``sum_i 0.8**i * loss_i`` (SpecForge's ``ploss_decay``).

The positions may also come gathered, as rows (``head_positions = "trained"``, draft/rows.py): ``logits`` and the
target ``(N, Vd)``, ``mask`` a weight per row, and ``positions`` the batch's ``B*T`` for the ``all_positions`` mean.
The sums are the same; only the untrained positions' zero terms are left out.

LK losses (``loss = "lk_lambda" | "lk_alpha"``; arXiv 2602.23881, SpecForge's ``lk_loss_type``, its
``specforge/core/lk_loss.py``) train on the acceptance rate itself. Per position, with ``q = softmax(z)`` and
``p~`` the target's probabilities of the draft tokens out of its WHOLE vocabulary (not renormalised: a served
draft token outside the target's mass is rejected), ``alpha_bt = sum_v min(p~_btv, q_btv)`` is the probability
that speculative sampling accepts the draft. ``A = sum m alpha / max(sum m, 1e-8)`` (and ``L`` the same mean of
``log alpha``, 0 where ``alpha`` is 0) over the step's trained positions:

* ``lk_alpha``: ``loss_i = -L``;
* ``lk_lambda``: ``loss_i = w * CE_i + (1 - w) * (1 - A)`` with ``w = lk_kl_scale * exp(-lk_kl_decay * A)``
  (``A`` detached in ``w``): the soft cross-entropy above while the drafter accepts little, the acceptance rate
  once it accepts much.

Both need the target's log-sum-exp over its whole vocabulary: with an LK loss the target hands ``lse`` over every
token (``needs_full_vocab_lse``), and the cross-entropy part renormalises over the draft vocabulary itself.

``A`` and ``L`` are each replica's own masked means (its batch's positions), and the replicas (threads, ranks)
average their gradients after the backward (run/worker.py). On one device that is SpecForge's loss exactly. With
several replicas it is what SpecForge's data-parallel ranks do too (its ``SdpaLikeAdapter.reduce_metrics`` is the
identity; DDP averages the gradients): each replica is weighted by its own ``A`` in ``w`` and its own position
count, not by the global sums. SpecForge sums numerator and denominator across ranks only inside a
sequence-parallel group (``UspAdapter``: one sequence split over GPUs), which has no counterpart here; global sums
would need an exchange between the forward and the backward of every step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.trainer.config import LOSS_LK_ALPHA, LOSS_LK_LAMBDA, LOSS_MEAN_ALL, LOSS_MEAN_MASKED, LOSS_MEANS, LOSSES

LossFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

STEP_WEIGHT_DECAY = 0.8  # the loss trained on is sum_i STEP_WEIGHT_DECAY**i * loss_i over TTT positions


def target_probabilities(target_logits: torch.Tensor, target_lse: torch.Tensor) -> torch.Tensor:
    """``p = exp(z_t - lse_t)`` in float32, ``(B, T, Vd)``: the target's distribution over the draft vocabulary."""
    return torch.exp(target_logits.float() - target_lse.unsqueeze(-1))


def _soft_cross_entropy(
    logits: torch.Tensor,  # (B, T, Vd): the drafter's
    target_logits: torch.Tensor,  # (B, T, Vd): the target's over the draft vocabulary, shifted to this step
    target_lse: torch.Tensor,  # (B, T) float32: their log-sum-exp, shifted (+inf past the end: p = 0)
    mask: torch.Tensor,  # (B, T): the position mask m, shifted
    loss_mask: torch.Tensor | None,  # (B, T): the data's loss mask l, shifted
    mean: str,
    positions: int | None = None,  # the batch's B*T when the rows are a gathered subset (draft/rows.py)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # loss, correct, count: each ()
    m = mask.to(torch.float32)
    z = logits.float()
    p = target_probabilities(target_logits, target_lse)
    # -sum_v p_v log_softmax(z)_v = lse(z) * sum_v p_v - sum_v p_v z_v: reductions one pass over a row makes
    # together, with no log-probabilities tensor between them (sum_v p_v is 1 up to rounding, 0 past the tail).
    per_position = torch.logsumexp(z, dim=-1) * p.sum(dim=-1) - (p * z).sum(dim=-1)
    summed = (per_position * m).sum()
    every = float(m.numel() if positions is None else positions)
    denominator = every if mean == LOSS_MEAN_ALL else m.sum().clamp_min(1.0)
    loss = summed / denominator
    # argmax z_t is argmax p (exp is increasing); past the tail both are 0 and m is 0.
    hits = (logits.argmax(dim=-1) == target_logits.argmax(dim=-1)).to(torch.float32) * m
    count = (loss_mask.to(torch.float32) if loss_mask is not None else m).sum()
    return loss, hits.sum(), count


def soft_cross_entropy(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    target_lse: torch.Tensor,
    mask: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    positions: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss over all B*T positions, correct top-1 count, accuracy denominator): SpecForge's normalisation."""
    return _soft_cross_entropy(logits, target_logits, target_lse, mask, loss_mask, LOSS_MEAN_ALL, positions)


def soft_cross_entropy_masked_mean(
    logits: torch.Tensor,
    target_logits: torch.Tensor,
    target_lse: torch.Tensor,
    mask: torch.Tensor,
    loss_mask: torch.Tensor | None = None,
    positions: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss over the masked positions only, correct top-1 count, accuracy denominator)."""
    return _soft_cross_entropy(logits, target_logits, target_lse, mask, loss_mask, LOSS_MEAN_MASKED, positions)


LK_EPS = 1e-8  # the acceptance means' denominator floor (SpecForge's _masked_mean eps)


def acceptance_rates(
    logits: torch.Tensor,  # (B, T, Vd): the drafter's
    target_logits: torch.Tensor,  # (B, T, Vd): the target's over the draft vocabulary
    target_lse_full: torch.Tensor,  # (B, T) float32: the log-sum-exp of ALL the target's logits (+inf: p = 0)
    mask: torch.Tensor,  # (B, T): the position mask m
) -> tuple[torch.Tensor, torch.Tensor]:  # A, L: each ()
    """The masked means of ``alpha = sum_v min(p~, q)`` and of ``log alpha`` (0 where alpha is 0)."""
    m = mask.to(torch.float32)
    p_on_draft = torch.exp(target_logits.float() - target_lse_full.unsqueeze(-1))
    alpha = torch.minimum(p_on_draft, torch.softmax(logits.float(), dim=-1)).sum(dim=-1)
    # 0 where alpha is 0 (positions past the end), as SpecForge's where(alpha > 0, log alpha, 0), without a log(0)
    log_alpha = torch.log(torch.where(alpha > 0, alpha, torch.ones_like(alpha)))
    denominator = m.sum().clamp_min(LK_EPS)
    return (alpha * m).sum() / denominator, (log_alpha * m).sum() / denominator


def lk_loss(kind: str, mean: str, kl_scale: float = 1.0, kl_decay: float = 1.0) -> LossFn:
    """The LK loss ``kind`` (LOSS_LK_LAMBDA or LOSS_LK_ALPHA) as a LossFn; its ``target_lse`` is over the
    target's whole vocabulary (see the module docstring), its cross-entropy part normalised as ``mean`` says."""
    if kind not in (LOSS_LK_LAMBDA, LOSS_LK_ALPHA):
        raise ValueError(f"LK loss {kind!r}; allowed: {LOSS_LK_LAMBDA}, {LOSS_LK_ALPHA}")
    if mean not in LOSS_MEANS:
        raise ValueError(f"loss_mean {mean!r}; allowed: {', '.join(LOSS_MEANS)}")

    def lk(
        logits: torch.Tensor,
        target_logits: torch.Tensor,
        target_lse: torch.Tensor,
        mask: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        positions: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        accept, log_accept = acceptance_rates(logits, target_logits, target_lse, mask)
        # the soft cross-entropy against the target renormalised over the draft vocabulary, and the top-1 counts
        draft_lse = torch.logsumexp(target_logits.float(), dim=-1)
        ce, correct, count = _soft_cross_entropy(logits, target_logits, draft_lse, mask, loss_mask, mean, positions)
        if kind == LOSS_LK_ALPHA:
            return -log_accept, correct, count
        weight = kl_scale * torch.exp(-kl_decay * accept.detach())
        return weight * ce + (1 - weight) * (1 - accept), correct, count

    return lk


def needs_full_vocab_lse(kind: str) -> bool:
    """Whether the loss ``kind`` reads the target's log-sum-exp over its whole vocabulary (the LK losses)."""
    return kind in (LOSS_LK_LAMBDA, LOSS_LK_ALPHA)


def loss_function(mean: str, kind: str = LOSSES[0], kl_scale: float = 1.0, kl_decay: float = 1.0) -> LossFn:
    """The loss function for the ``loss_mean`` and ``loss`` config keys (LOSS_MEANS, LOSSES) and the LK knobs."""
    if mean not in LOSS_MEANS:
        raise ValueError(f"loss_mean {mean!r}; allowed: {', '.join(LOSS_MEANS)}")
    if kind not in LOSSES:
        raise ValueError(f"loss {kind!r}; allowed: {', '.join(LOSSES)}")
    if needs_full_vocab_lse(kind):
        return lk_loss(kind, mean, kl_scale, kl_decay)
    return soft_cross_entropy if mean == LOSS_MEAN_ALL else soft_cross_entropy_masked_mean


def step_weights(ttt_steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return STEP_WEIGHT_DECAY ** torch.arange(ttt_steps, dtype=torch.float32, device=device)


def weighted_total(loss: list[float]) -> float:
    """The training loss of one step from its per-position losses (the log line's and the chart's ``loss``)."""
    return sum(STEP_WEIGHT_DECAY**i * v for i, v in enumerate(loss))


def total_loss(losses: torch.Tensor) -> torch.Tensor:  # (ttt_steps,) -> ()
    return (losses * step_weights(losses.numel(), losses.device)).sum()


def accuracies(correct: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # (ttt_steps,) each -> (ttt_steps,)
    """acc_i = correct_i / counts_i (0 where a step counted no position)."""
    return correct / counts.clamp_min(1.0)
