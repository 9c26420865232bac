"""The training-time-test (TTT) attention mask.

At TTT step ``i`` the queries are the ``T`` positions of this step and the keys are the K/V of steps
``0..i`` laid side by side (length ``(i + 1) * T``). Query ``q`` sees block 0 causally (``kv <= q``) and,
in every later block ``j``, only its own position (the diagonal: ``kv - j * T == q``).

Packed rows (data/packing.py) add one condition to block 0: the key is in the query's document
(``documents[b, kv] == documents[b, q]``), so no token attends across conversations; the diagonals are a
token's own position and need none. That mask depends on the batch, so it is made per batch, not cached:
block 0's tiles once (``create_block_mask`` over ``T x T``), and every later step's by appending the diagonal
tile of each later block (``extend_document_block_mask``), not by evaluating the mask over ``T x (i + 1) T``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

FLEX_TILE = 128  # flex_attention's block (tile) size, queries and keys, for the packed masks made here


def ttt_mask_mod(seq_len: int) -> Callable[[Any, Any, Any, Any], Any]:
    """flex_attention mask_mod for a bucket of ``seq_len`` tokens (valid for any step)."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        block = kv_idx // seq_len
        pos = kv_idx % seq_len
        return ((block == 0) & (pos <= q_idx)) | (pos == q_idx)

    return mask_mod


def dense_ttt_mask(seq_len: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The same mask materialised: bool ``(seq_len, (step + 1) * seq_len)``, True where attention is allowed."""
    q = torch.arange(seq_len, device=device)[:, None]
    kv = torch.arange((step + 1) * seq_len, device=device)[None, :]
    return ttt_mask_mod(seq_len)(None, None, q, kv)


def unmasked_pairs(seq_len: int, step: int) -> int:
    """How many (query, key) pairs the mask allows at one step: causal block plus ``step`` diagonals."""
    return seq_len * (seq_len + 1) // 2 + step * seq_len


def document_ttt_mask_mod(documents: torch.Tensor) -> Callable[[Any, Any, Any, Any], Any]:
    """flex_attention mask_mod for packed rows: ``documents`` ``(B, T)`` numbers each row's conversations."""
    seq_len = documents.shape[-1]

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        block = kv_idx // seq_len
        pos = kv_idx % seq_len
        same = documents[b, pos] == documents[b, q_idx]
        return ((block == 0) & (pos <= q_idx) & same) | (pos == q_idx)

    return mask_mod


def dense_document_ttt_mask(documents: torch.Tensor, step: int) -> torch.Tensor:
    """The packed mask materialised: bool ``(B, 1, T, (step + 1) * T)``, True where attention is allowed."""
    seq_len = documents.shape[-1]
    base = dense_ttt_mask(seq_len, step, documents.device)  # (T, K)
    pos = torch.arange((step + 1) * seq_len, device=documents.device) % seq_len
    first_block = torch.arange((step + 1) * seq_len, device=documents.device) < seq_len
    same = documents[:, :, None] == documents[:, None, pos]  # (B, T, K)
    return (base & (same | ~first_block))[:, None]


def extend_document_block_mask(first: Any, documents: torch.Tensor, step: int) -> Any:
    """Step ``step``'s flex BlockMask of a packed batch from step 0's (``first``, over ``T x T``).

    Block 0 keeps ``first``'s tiles; block ``j >= 1`` adds, for query tile ``q``, its diagonal tile ``j * nb + q``
    (partial: only the diagonal is allowed). Needs ``T`` to be a multiple of the tile size (the caller checks).
    """
    from torch.nn.attention.flex_attention import BlockMask

    seq_len = documents.shape[-1]
    if step == 0:
        return first
    kv_num, kv_idx = first.kv_num_blocks, first.kv_indices  # (B, H, nq), (B, H, nq, nb)
    b, h, nq, nb = kv_idx.shape
    indices = kv_idx.new_zeros(b, h, nq, (step + 1) * nb)
    indices[..., :nb] = kv_idx
    q_tiles = torch.arange(nq, device=kv_idx.device, dtype=kv_idx.dtype).expand(b, h, nq)
    for j in range(1, step + 1):  # after block 0's partial tiles, in ascending order
        indices.scatter_(-1, (kv_num.long() + (j - 1)).unsqueeze(-1), (j * nb + q_tiles).unsqueeze(-1))
    full_idx = None
    if first.full_kv_indices is not None:
        full_idx = first.full_kv_indices.new_zeros(b, h, nq, (step + 1) * nb)
        full_idx[..., :nb] = first.full_kv_indices
    return BlockMask.from_kv_blocks(
        kv_num + step,
        indices,
        first.full_kv_num_blocks,
        full_idx,
        BLOCK_SIZE=first.BLOCK_SIZE,
        mask_mod=document_ttt_mask_mod(documents),
        seq_lengths=(seq_len, (step + 1) * seq_len),
    )


class BlockMaskCache:
    """flex BlockMasks per (device, seq_len, step); created once (under the compile guard by the caller)."""

    def __init__(self) -> None:
        self._masks: dict[tuple[str, int, int], Any] = {}

    def get(self, device: torch.device, seq_len: int, step: int) -> Any:
        key = (str(device), seq_len, step)
        mask = self._masks.get(key)
        if mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            mask = create_block_mask(
                ttt_mask_mod(seq_len),
                B=None,
                H=None,
                Q_LEN=seq_len,
                KV_LEN=(step + 1) * seq_len,
                device=str(device),
            )
            self._masks[key] = mask
        return mask

    def __contains__(self, key: tuple[str, int, int]) -> bool:
        return key in self._masks
