"""Sequence packing: several conversations per row of a bucket, each row's documents kept apart.

A packed row holds whole conversations side by side; ``documents`` (``(B, T)`` integers) numbers them
``0, 1, ...`` from the left, and the padding after the last one is one more document of its own. Everything
that must not cross a conversation reads that tensor: the target's attention (``document_causal_mask``) and
positions (``document_positions``, restarting at 0 in every document), the drafter's TTT mask
(draft/masks.py) and its shifted targets (``same_document_after``: position ``t`` at shift ``s`` trains only
where ``t + s`` is in the same document).

Which conversations share a row (``PackingPlan``): the epoch-0 permutation of the corpus, cut into windows of
``PACK_WINDOW_ROWS * batch_size`` conversations, each window packed best-fit decreasing (the longest first,
each into the row it leaves least room in), so that rows stay mixed across the corpus yet nearly full. The
rows are fixed for the run; every epoch shuffles their order (seeded by ``seed + epoch``), so a batch is still a
pure function of its index and every conversation is trained once an epoch. The last batch of an epoch may
carry empty rows (all padding, nothing trained) rather than drop conversations.
"""

from __future__ import annotations

import bisect
import random
import threading
from dataclasses import dataclass, field

import torch

PACK_WINDOW_ROWS = 64  # rows' worth of conversations packed together: larger fills rows better, mixes less


@dataclass(frozen=True)
class PackingPlan:
    """Rows of conversation indices, each row's lengths summing to at most ``capacity`` tokens."""

    rows: list[list[int]]
    capacity: int
    batch_size: int
    seed: int
    # The current epoch's row order, made once an epoch (a shuffle of every row is too slow for each batch).
    _order: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @classmethod
    def build(cls, lengths: list[int], *, capacity: int, batch_size: int, seed: int) -> PackingPlan:
        if any(n > capacity or n <= 0 for n in lengths):
            raise ValueError(f"every conversation must hold 1..{capacity} tokens to be packed")
        order = list(range(len(lengths)))
        random.Random(seed * 1_000_003).shuffle(order)
        window = PACK_WINDOW_ROWS * batch_size
        rows: list[list[int]] = []
        for lo in range(0, len(order), window):
            rows.extend(best_fit_decreasing(order[lo : lo + window], lengths, capacity))
        return cls(rows=rows, capacity=capacity, batch_size=batch_size, seed=seed)

    @property
    def batches_per_epoch(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def batch_rows(self, index: int) -> list[list[int]]:
        """The rows of batch ``index`` (``batch_size`` of them; empty lists are rows of padding)."""
        epoch, offset = divmod(index, self.batches_per_epoch)
        with self._lock:
            order = self._order.get(epoch)
            if order is None:
                order = list(range(len(self.rows)))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
                self._order.clear()  # keep only the current epoch's
                self._order[epoch] = order
        picked = order[offset * self.batch_size : (offset + 1) * self.batch_size]
        return [self.rows[r] for r in picked] + [[] for _ in range(self.batch_size - len(picked))]


def best_fit_decreasing(items: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    """Pack ``items`` (indices into ``lengths``) into rows of ``capacity``: longest first, tightest row first."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row number), sorted
    for i in sorted(items, key=lambda j: (-lengths[j], j)):
        at = bisect.bisect_left(free, (lengths[i], -1))
        if at < len(free):
            room, row = free.pop(at)
        else:
            room, row = capacity, len(rows)
            rows.append([])
        rows[row].append(i)
        left = room - lengths[i]
        if left > 0:
            bisect.insort(free, (left, row))
    return rows


def pack_rows(
    rows: list[list[tuple[torch.Tensor, torch.Tensor]]], bucket: int, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids (B, T) long, loss_mask (B, T) float32, documents (B, T) int64) of rows of (ids, mask) pairs."""
    b = len(rows)
    ids_t = torch.full((b, bucket), pad_id, dtype=torch.long)
    mask_t = torch.zeros((b, bucket), dtype=torch.float32)
    docs_t = torch.zeros((b, bucket), dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for d, (ids, mask) in enumerate(row):
            n = int(ids.numel())
            if at + n > bucket:
                raise ValueError(f"row {r} holds more than {bucket} tokens")
            ids_t[r, at : at + n] = ids.long()
            mask_t[r, at : at + n] = mask.float()
            docs_t[r, at : at + n] = d
            at += n
        docs_t[r, at:] = len(row)  # the padding is a document of its own
    return ids_t, mask_t, docs_t


def document_positions(documents: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T) long
    """Each token's position inside its own document: 0 at every document's first token."""
    t = documents.shape[-1]
    arange = torch.arange(t, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, arange, torch.zeros_like(arange)).cummax(dim=-1).values
    return arange - first


def same_document_after(documents: torch.Tensor, shift: int) -> torch.Tensor:  # (B, T) -> (B, T) bool
    """True at ``t`` where token ``t + shift`` exists and is in ``t``'s document (a TTT target inside it)."""
    out = torch.zeros_like(documents, dtype=torch.bool)
    t = documents.shape[-1]
    if shift < t:
        out[..., : t - shift] = documents[..., shift:] == documents[..., : t - shift]
    return out


def document_causal_mask(documents: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, 1, T, T) bool
    """The target's attention in a packed row: causal, and only inside the query's document."""
    t = documents.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=documents.device).tril()
    same = documents[:, :, None] == documents[:, None, :]
    return (same & causal)[:, None]
