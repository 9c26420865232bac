"""The positions each TTT step trains on, so that the head and the loss run on those rows only.

A position counts in step ``i``'s loss only where its shifted position mask is set (the data's loss mask, the
target's top token in the draft vocabulary, inside its own conversation when rows are packed); everywhere else
its loss and its gradient are zero. The decoder layer must still run at every position (its keys and hidden states
feed the other positions and the next step), but the draft-vocabulary head (``B*T x H x Vd``, about a third of a
step's GEMM work at the 8B shape) and the loss's reductions over ``Vd`` need not: ``head_positions = "trained"``
gathers the trained rows first and runs the head and the loss on them (draft/model.py ``ttt_step``). The losses,
accuracies and gradients are the same sums over the same terms, in another order.

What it saves is the untrained share of positions: on conversations the prompts (loss mask 0) and the positions
whose target token is outside the draft vocabulary; on random tokens through a random target (the throughput
benchmark) about three quarters of the positions, since the target's top token then falls in a 32k draft
vocabulary out of 128k about one time in four.

Shapes: step ``i``'s rows are padded with row 0 at weight 0 up to the next count that is 8 more than a multiple of
16 (at least 8; one quantum more where that would be ``B*T``), and the row dimension is marked dynamic, so one
compiled graph per step takes every count. Such a count is never 0 or 1 (sizes a compiled graph specialises on),
never ``B*T``, and never any other multiple of 16 (the hidden sizes and vocabularies of real models, and ``B*T``
when the buckets are): a graph first compiled at a count equal to a static size of the step was specialised to it
on an H100 (the three TTT steps whose warm-up count was padded to ``B*T`` compiled again at the first real batch;
the four padded to ``B*T - 16`` did not). Not solved by this padding: at the 8B shape a warm-up count stepped over
``B*T`` (8200 at ``B*T = 8192``, TTT step 1) still compiled once more at the first real batch, and counts below
``B*T`` did not; the guard behind it was not found (tests/bench/results/throughput_rows_h100.txt). So the warm-up
batch (run/worker.py ``synthetic_batch``) leaves a prompt untrained and its counts stay below ``B*T``: the first
real batch then compiled nothing on an H100 at batch 4. At batch 8 (warm-up counts about 12,280, real ones 4,230)
every step compiled again at the first real batch, so a count guard is not about ``B*T`` alone (8,184 and below
never failed, 8,200 and above did: a size near 8,192); warm-up now trains at two prompt shares, a quarter and three
quarters of each row (run/worker.py ``WARMUP_PROMPT_SHARES``), so counts on both sides compile there. A guard that
still fails is a compile event, serialised by the guard, and names the guard (threads/compile.py). The counts are
read to the host once an unroll (``torch.nonzero_static`` needs them); the producer does that right after the
target's forward, off the drafter's critical path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.trainer.data.packing import same_document_after

ROW_QUANTUM = 16  # row counts are padded up to ROW_OFFSET more than a multiple of this (see above)
ROW_OFFSET = 8


@dataclass(frozen=True)
class TrainedRows:
    """Per TTT step ``i``: the flat ``(b * T + t)`` positions it trains (``index``, int64) and a weight per row
    (``weight``, float32: 1 for a trained position, 0 for padding). Position ``t`` of step ``i`` predicts the target
    at ``t + i + 1``, in the same row (the rows never reach past their sequence)."""

    index: tuple[torch.Tensor, ...]
    weight: tuple[torch.Tensor, ...]
    counts: tuple[int, ...]  # trained positions per step (the unpadded row counts)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TrainedRows:
        return TrainedRows(
            tuple(t.to(device, non_blocking=non_blocking) for t in self.index),
            tuple(t.to(device, non_blocking=non_blocking) for t in self.weight),
            self.counts,
        )

    def step(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``i``'s (index, weight), their row dimension marked dynamic for torch.compile."""
        index, weight = self.index[i], self.weight[i]
        mark_rows_dynamic(index, weight)
        return index, weight


def mark_rows_dynamic(*tensors: torch.Tensor) -> None:
    """Dim 0 of each tensor is a row count that changes from batch to batch: one compiled graph for all of them."""
    try:
        import torch._dynamo as dynamo
    except ImportError:  # pragma: no cover - torch without dynamo: nothing compiles
        return
    for t in tensors:
        dynamo.mark_dynamic(t, 0)


def step_masks(position_mask: torch.Tensor, documents: torch.Tensor | None, ttt_steps: int) -> torch.Tensor:
    """``(ttt_steps, B, T)`` bool: step ``i``'s shifted position mask (draft/model.py ``ttt_step``'s ``mask_i``)."""
    b, t = position_mask.shape
    out = torch.zeros(ttt_steps, b, t, dtype=torch.bool, device=position_mask.device)
    held = position_mask > 0
    for i in range(ttt_steps):
        shift = i + 1
        if shift >= t:
            continue
        step = held[:, shift:]
        if documents is not None:
            step = step & same_document_after(documents, shift)[:, : t - shift]
        out[i, :, : t - shift] = step
    return out


def row_count(count: int, positions: int) -> int:
    """The padded row count for ``count`` trained positions out of ``positions`` (``B*T``): the least
    ``n >= max(count, ROW_OFFSET)`` with ``n % ROW_QUANTUM == ROW_OFFSET``, or the next such ``n`` where that one
    is ``positions`` (never 0 or 1, never ``B*T``, never a multiple of 16)."""
    size = max(ROW_OFFSET, count + (ROW_OFFSET - count) % ROW_QUANTUM)
    return size + ROW_QUANTUM if size == positions else size


def nonzero_padded(mask: torch.Tensor, size: int) -> torch.Tensor:
    """``mask.nonzero()`` of a 1-D mask padded with 0 to ``size`` entries (``size`` >= the count): in one kernel
    without a host read where ``torch.nonzero_static`` runs on the device (CUDA from torch 2.6), else in two."""
    try:
        return torch.nonzero_static(mask, size=size, fill_value=0).squeeze(1)
    except (NotImplementedError, RuntimeError):  # torch 2.5's CUDA has no nonzero_static kernel
        rows = mask.nonzero().squeeze(1)
        return torch.cat((rows, rows.new_zeros(size - rows.numel())))


def trained_rows(position_mask: torch.Tensor, documents: torch.Tensor | None, ttt_steps: int) -> TrainedRows:
    """The rows every TTT step of this batch trains (one device-to-host read of the counts)."""
    masks = step_masks(position_mask, documents, ttt_steps).flatten(1)  # (ttt_steps, B*T)
    counts = [int(c) for c in masks.sum(dim=1).tolist()]
    index, weight = [], []
    for i, count in enumerate(counts):
        size = row_count(count, masks.shape[1])
        rows = nonzero_padded(masks[i], size)
        index.append(rows)
        weight.append((torch.arange(size, device=rows.device) < count).to(torch.float32))
    return TrainedRows(tuple(index), tuple(weight), tuple(counts))
