"""The TTT mask and the attention paths (flex eager on the CPU, SDPA with the materialised mask, merged)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.masks import dense_ttt_mask, ttt_mask_mod, unmasked_pairs
from engine.trainer.draft.merged import _in_layout_of, kernel_for

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


@pytest.mark.parametrize("step", [0, 1, 3, 6])
def test_merged_attention_and_its_gradients_equal_the_masked_softmax(step: int) -> None:
    """Block 0 in ATen's flash kernel plus the diagonals merged by log-sum-exp, against dense masked SDPA.

    float64 throughout, so the merge's algebra (and the backward through the kernel with the merged lse) is
    checked to rounding: 1e-12 relative. Grouped-query heads (4 query heads a key head) included."""
    torch.manual_seed(100 + step)
    b, hq, hkv, seq_len, d = 2, 8, 2, 48, 16
    q = torch.randn(b, hq, seq_len, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, (step + 1) * seq_len, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, (step + 1) * seq_len, d, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, hq, seq_len, d, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_ttt_mask(seq_len, step), enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    merged = TTTAttention("merged")(q, k, v, step)
    grads = torch.autograd.grad(merged, (q, k, v), dout)
    torch.testing.assert_close(merged, ref, rtol=1e-12, atol=1e-12)
    for got, want, name in zip(grads, ref_grads, ("dq", "dk", "dv"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_merged_attention_in_float32_on_transposed_projections() -> None:
    """The layout the drafter hands over: q and step 0's k/v are (B, T, H, D) projections transposed."""
    torch.manual_seed(7)
    b, hq, hkv, seq_len, d, step = 2, 4, 2, 32, 16, 2
    q = torch.randn(b, seq_len, hq, d).transpose(1, 2).requires_grad_()
    k = torch.randn(b, hkv, (step + 1) * seq_len, d, requires_grad=True)
    v = torch.randn(b, hkv, (step + 1) * seq_len, d, requires_grad=True)
    ref = TTTAttention("sdpa")(q, k, v, step)
    merged = TTTAttention("merged")(q, k, v, step)
    torch.testing.assert_close(merged, ref, rtol=1e-5, atol=1e-5)
    got, want = torch.autograd.grad(merged.sum(), (q, k, v)), torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_merged_attention_of_packed_rows_on_the_cpu_uses_the_document_mask() -> None:
    documents = torch.tensor([[0] * 20 + [1] * 12, [0] * 32])
    made = TTTAttention("merged").prepare(documents.device, 32, 2, documents)
    assert isinstance(made, torch.Tensor) and made.shape == (2, 1, 32, 96)


def test_merged_kernel_choice_follows_the_head_size_and_refuses_what_no_kernel_takes() -> None:
    assert kernel_for("cudnn", 128) == "cudnn" and kernel_for("cudnn", 256) == "flash"
    assert kernel_for("flash", 64) == "flash" and kernel_for("cpu", 12) == "cpu"
    with pytest.raises(ValueError, match=r"no fused CUDA kernel for 12-wide heads; use attention = 'flex'"):
        kernel_for("cudnn", 12)
    with pytest.raises(ValueError, match=r"backend 'tpu'"):
        kernel_for("tpu", 64)


@pytest.mark.parametrize("transposed", [False, True])
def test_dout_is_handed_to_the_kernel_in_the_layout_of_its_output(transposed: bool) -> None:
    ref = torch.randn(2, 5, 4, 8).transpose(1, 2) if transposed else torch.randn(2, 4, 5, 8)
    dout = torch.randn(2, 4, 5, 8) if transposed else torch.randn(2, 5, 4, 8).transpose(1, 2)  # the other layout
    assert dout.stride() != ref.stride()
    got = _in_layout_of(dout, ref)
    assert got.stride() == ref.stride() and torch.equal(got, dout)
