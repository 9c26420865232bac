"""Attention over the TTT key/value blocks: merged, flex_attention with a block-sparse mask, or SDPA with the mask.

``merged`` (merged.py) runs block 0 in a fused causal kernel and merges the diagonals by log-sum-exp: no tile is
computed for a diagonal (on the CPU only: its CUDA gradients were measured wrong, see merged.py). flex_attention
skips the fully masked blocks (all off-diagonal blocks after the first) but computes each diagonal as whole tiles.
On the CPU flex_attention has no backward (torch 2.13 raises NotImplementedError), so CPU training uses
scaled-dot-product attention with the same mask materialised; tests check that the paths agree.

Packed rows (``documents`` given) get a per-batch mask that keeps every conversation to itself (masks.py):
a BlockMask made for the batch (flex, and merged on CUDA), or the dense ``(B, 1, T, K)`` mask.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.trainer.draft.masks import (
    FLEX_TILE,
    BlockMaskCache,
    dense_document_ttt_mask,
    dense_ttt_mask,
    document_ttt_mask_mod,
    extend_document_block_mask,
)
from engine.trainer.draft.merged import default_backend, merged_ttt_attention
from engine.trainer.threads.compile import GuardedFunction, compile_guard

IMPLS: tuple[str, ...] = ("merged", "flex", "sdpa")
DOCUMENT_MASKS_KEPT = 4  # packed batches whose step-0 BlockMask is kept (one a worker in flight)


@dataclass(frozen=True)
class MergedMask:
    """The mask argument of the merged attention: the TTT mask is implied, only the kernel is chosen."""

    backend: str


class TTTAttention:
    """Callable ``(q, k_all, v_all, step) -> out`` with q ``(B, Hq, T, D)`` and k/v ``(B, Hkv, (step+1)T, D)``."""

    def __init__(self, impl: str, *, compiled: bool = False, flex_bwd_num_stages: int = 0) -> None:
        if impl not in IMPLS:
            raise ValueError(f"attention impl {impl!r}; allowed: {', '.join(IMPLS)}")
        self.impl = impl
        self.compiled = compiled
        # flex's Triton kernel options (CUDA): the backward's pipelining stages when set, else inductor's choice
        self.flex_options: dict[str, Any] = {"bwd_num_stages": flex_bwd_num_stages} if flex_bwd_num_stages else {}
        self._block_masks = BlockMaskCache()
        self._dense: dict[tuple[str, int, int], torch.Tensor] = {}
        self._lock = threading.Lock()
        # Packed batches' step-0 BlockMasks by the documents tensor (held, so its id is not reused meanwhile).
        self._document_first: dict[int, tuple[torch.Tensor, Any]] = {}
        self._flex: GuardedFunction | None = None
        if impl in ("flex", "merged"):  # merged: flex for packed rows on CUDA
            from torch.nn.attention.flex_attention import flex_attention

            self._flex = GuardedFunction(flex_attention, compiled=compiled, name="flex_attention")

    def compiled_functions(self) -> list[GuardedFunction]:
        """The compiled functions this attention calls (for compile-event listeners and ``mark_warm``)."""
        return [self._flex] if self._flex is not None and self._flex.compiled else []

    def mark_warm(self) -> None:
        for fn in self.compiled_functions():
            fn.mark_warm()

    def block_mask(self, device: torch.device, seq_len: int, step: int) -> Any:
        key = (str(device), seq_len, step)
        if key in self._block_masks:
            return self._block_masks.get(device, seq_len, step)
        with compile_guard():  # mask creation can trace (vmap over the mask_mod)
            return self._block_masks.get(device, seq_len, step)

    def dense_mask(self, device: torch.device, seq_len: int, step: int) -> torch.Tensor:
        key = (str(device), seq_len, step)
        with self._lock:
            mask = self._dense.get(key)
            if mask is None:
                mask = dense_ttt_mask(seq_len, step, device)
                self._dense[key] = mask
        return mask

    def document_mask(self, documents: torch.Tensor, step: int) -> Any:
        """The mask of a packed batch at this step (``documents`` ``(B, T)``): made for this batch.

        flex: step 0's tiles once a batch (kept for its later steps), each later step's extended from them."""
        if self.impl == "sdpa" or (self.impl == "merged" and documents.device.type != "cuda"):
            return dense_document_ttt_mask(documents, step)
        from torch.nn.attention.flex_attention import create_block_mask

        b, t = documents.shape
        if t % FLEX_TILE:  # diagonals would straddle tiles: evaluate the whole mask
            with compile_guard():  # mask creation can trace (vmap over the mask_mod)
                return create_block_mask(
                    document_ttt_mask_mod(documents),
                    B=b,
                    H=None,
                    Q_LEN=t,
                    KV_LEN=(step + 1) * t,
                    device=str(documents.device),
                    BLOCK_SIZE=FLEX_TILE,
                )
        with self._lock:
            held = self._document_first.get(id(documents))
        if held is None or held[0] is not documents:
            with compile_guard():
                first = create_block_mask(
                    document_ttt_mask_mod(documents),
                    B=b,
                    H=None,
                    Q_LEN=t,
                    KV_LEN=t,
                    device=str(documents.device),
                    BLOCK_SIZE=FLEX_TILE,
                )
            with self._lock:
                while len(self._document_first) >= DOCUMENT_MASKS_KEPT:
                    self._document_first.pop(next(iter(self._document_first)))
                self._document_first[id(documents)] = (documents, first)
            held = (documents, first)
        return extend_document_block_mask(held[1], documents, step)

    def prepare(self, device: torch.device, seq_len: int, step: int, documents: torch.Tensor | None = None) -> Any:
        """The mask argument for ``apply`` at this step: a flex BlockMask or the dense bool mask.

        ``documents`` (``(B, T)``, packed rows): the per-batch mask that keeps each conversation to itself."""
        if documents is not None:
            return self.document_mask(documents, step)
        if self.impl == "merged":
            return MergedMask(default_backend(device))
        if self.impl == "flex":
            return self.block_mask(device, seq_len, step)
        return self.dense_mask(device, seq_len, step)

    def apply(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        if isinstance(mask, MergedMask):
            return merged_ttt_attention(q, k, v, mask.backend)
        gqa = q.shape[1] != k.shape[1]
        if not isinstance(mask, torch.Tensor) and self._flex is not None:
            options: Any = self.flex_options if q.is_cuda and self.flex_options else None  # a FlexKernelOptions
            if torch.compiler.is_compiling():  # inside a compiled TTT step: flex is fused into that graph
                from torch.nn.attention.flex_attention import flex_attention

                out = flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options)
            else:
                out = self._flex(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options)
            return out[0] if isinstance(out, tuple) else out
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, step: int) -> torch.Tensor:
        return self.apply(q, k, v, self.prepare(q.device, q.shape[-2], step))
