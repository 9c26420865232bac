"""The draft vocabulary: the most frequent trained tokens over the whole training set, with EAGLE-3's d2t / t2d
maps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.trainer.data.sources import BatchSource


@dataclass
class DraftVocab:
    draft_to_target: torch.Tensor  # (Vd,) long, ascending target ids

    @property
    def size(self) -> int:
        return int(self.draft_to_target.numel())

    def d2t(self) -> torch.Tensor:
        """EAGLE-3's offsets: target id = draft id + d2t[draft id]."""
        return self.draft_to_target - torch.arange(self.size)

    def coverage(self, counts: torch.Tensor) -> float | None:
        """The share of the counted tokens (``counts``: per target id) that are in the draft vocabulary; None when
        nothing was counted."""
        total = int(counts.sum())
        ids = self.draft_to_target[self.draft_to_target < counts.numel()]
        return int(counts[ids].sum()) / total if total else None

    def t2d(self, vocab_size: int) -> torch.Tensor:
        """Bool mask over the target vocabulary: True where the token is in the draft vocabulary."""
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.draft_to_target] = True
        return mask


def vocab_from_counts(counts: torch.Tensor, draft_size: int) -> DraftVocab:
    """Top ``draft_size`` ids by count (ties: lower id first); unseen ids fill the rest in id order."""
    vocab_size = counts.numel()
    if draft_size > vocab_size:
        raise ValueError(f"draft_vocab_size {draft_size} exceeds the target vocabulary ({vocab_size})")
    ids = torch.arange(vocab_size)
    # Stable sort on -count keeps lower ids first among equal counts.
    order = torch.sort(-counts.to(torch.float64), stable=True).indices
    chosen = torch.sort(ids[order[:draft_size]]).values
    return DraftVocab(draft_to_target=chosen.long())


def build_draft_vocab(source: BatchSource, vocab_size: int, draft_size: int) -> DraftVocab:
    """The draft vocabulary from the token counts over the whole training set (not a sample of batches)."""
    return vocab_from_counts(source.token_counts(vocab_size), draft_size)
