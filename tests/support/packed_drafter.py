"""One drafter step on a target's outputs, packed or not: what the packing tests compare (the engine's own data
packing test and the target-family matrix's)."""

from __future__ import annotations

import torch

from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.loss import soft_cross_entropy, total_loss
from engine.trainer.draft.model import Drafter
from engine.trainer.verifier.model import FrozenTarget


def drafter_losses(
    target: FrozenTarget,
    drafter: Drafter,
    batch: tuple[torch.Tensor, ...],  # (ids, loss mask, documents), as data.packing.pack_rows makes them
    packed: bool,
    *,
    ttt_steps: int,
    draft_vocab: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(summed loss per TTT step, correct, counts, the trainable parameters' gradients) of one unroll on the
    target's states for ``batch``, with its documents when ``packed``, without them otherwise."""
    ids, mask, docs = batch
    documents = docs if packed else None
    out = target.run(ids, mask, torch.arange(draft_vocab), drafter.t2d, documents=documents)
    drafter.zero_grad(set_to_none=True)
    losses, correct, counts = drafter(
        out.hidden3,
        ids,
        out.target_logits,
        out.target_lse,
        out.position_mask,
        ttt_steps=ttt_steps,
        attention=TTTAttention("sdpa"),
        loss_fn=soft_cross_entropy,
        loss_mask=out.loss_mask,
        documents=documents,
    )
    summed = losses * ids.numel()  # soft_cross_entropy divides by B*T: the sum over positions is comparable
    total_loss(summed).backward()
    grads = [p.grad.detach().clone() for p in drafter.trainable_parameters() if p.grad is not None]
    return summed.detach(), correct, counts, grads
