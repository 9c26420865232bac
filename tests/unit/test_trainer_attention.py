"""The TTT mask and the two attention paths (flex eager on the CPU, SDPA with the materialised mask)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.masks import dense_ttt_mask, ttt_mask_mod, unmasked_pairs

TTT_STEPS = 7


def reference_mask(seq_len: int, step: int) -> torch.Tensor:
    """Written out position by position: causal over block 0, the diagonal of every later block."""
    ref = torch.zeros(seq_len, (step + 1) * seq_len, dtype=torch.bool)
    for q in range(seq_len):
        for kv in range(q + 1):
            ref[q, kv] = True
        for block in range(1, step + 1):
            ref[q, block * seq_len + q] = True
    return ref


@pytest.mark.parametrize("step", range(TTT_STEPS))
def test_flex_mask_equals_dense_reference_for_every_ttt_step(step: int) -> None:
    seq_len = 40
    ref = reference_mask(seq_len, step)
    flex_dense = create_mask(ttt_mask_mod(seq_len), None, None, seq_len, (step + 1) * seq_len, device="cpu")
    assert torch.equal(flex_dense.reshape(seq_len, -1), ref)
    assert torch.equal(dense_ttt_mask(seq_len, step), ref)
    assert int(ref.sum()) == unmasked_pairs(seq_len, step)


@pytest.mark.parametrize("step", [0, 3, 6])
def test_block_mask_keeps_exactly_the_blocks_that_hold_an_allowed_pair(step: int) -> None:
    seq_len, blk = 256, 128
    bm = create_block_mask(ttt_mask_mod(seq_len), None, None, seq_len, (step + 1) * seq_len, device="cpu")
    kept = bm.to_dense()[0, 0].bool()  # (q blocks, kv blocks)
    ref = reference_mask(seq_len, step)
    tiles = ref.reshape(seq_len // blk, blk, -1, blk).any(dim=(1, 3))
    assert torch.equal(kept, tiles)
    # Block-sparse: after block 0 only the diagonal tiles are computed.
    assert int(kept.sum()) == 3 + step * 2


@pytest.mark.parametrize("step", range(TTT_STEPS))
def test_flex_forward_equals_sdpa_path(step: int) -> None:
    torch.manual_seed(step)
    b, hq, hkv, seq_len, d = 2, 4, 2, 32, 16
    q = torch.randn(b, hq, seq_len, d)
    k = torch.randn(b, hkv, (step + 1) * seq_len, d)
    v = torch.randn(b, hkv, (step + 1) * seq_len, d)
    flex = TTTAttention("flex", compiled=False)(q, k, v, step)
    sdpa = TTTAttention("sdpa")(q, k, v, step)
    torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)
    # Also against flex with a plain (non-cached) mask, to pin the cache's keys.
    bm = create_block_mask(ttt_mask_mod(seq_len), None, None, seq_len, (step + 1) * seq_len, device="cpu")
    direct = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert isinstance(direct, torch.Tensor)
    torch.testing.assert_close(flex, direct, rtol=0, atol=0)
