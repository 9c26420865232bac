"""The unroll's q/k/v: one matmul over the stacked weights, the embedding half made once and shifted per TTT step.

Step ``i`` reads token ``t + 1 + i`` at position ``t`` (the padding token past the end), so the embedding half of
its q/k/v is step 0's shifted by ``i``. These tests hold the unroll against a reference written the way EAGLE-3
states the layer: every step embeds its own tokens and projects ``[norm(emb), norm(hidden)]`` through each of
q, k and v whole, in float64, where only summation order can differ.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.drafter_reference import own_tokens_step, step_embeddings

from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.loss import soft_cross_entropy, total_loss
from engine.trainer.draft.model import DraftConfig, Drafter, shift_left, shift_rows

VOCAB = 60
T = 20


def drafter() -> Drafter:
    cfg = DraftConfig(
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=VOCAB,
        draft_vocab_size=24,
        initializer_range=0.2,  # far from uniform attention, so a wrong token or position shows in the loss
    )
    torch.manual_seed(0)
    return Drafter(cfg, torch.randn(VOCAB, 32, dtype=torch.float64), torch.arange(24) * 2).double()


def unroll(model: Drafter, reference: bool, steps: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, T), generator=g)
    hidden3 = torch.randn(2, T, 96, generator=g, dtype=torch.float64)
    target_z = torch.randn(2, T, 24, generator=g, dtype=torch.float64) * 2
    mask = (torch.rand(2, T, generator=g) > 0.2).double()
    model.zero_grad(set_to_none=True)
    step_fn = own_tokens_step(step_embeddings(ids, model.embed_table, steps)) if reference else None
    losses, _, _ = model(
        hidden3,
        ids,
        target_z,
        torch.logsumexp(target_z, -1),
        mask,
        ttt_steps=steps,
        attention=TTTAttention("sdpa"),
        loss_fn=soft_cross_entropy,
        step_fn=step_fn,
        loss_mask=mask,
    )
    total_loss(losses).backward()
    return losses.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("n", [0, 1, 5, T - 1, T, T + 3])
def test_the_shifted_embedding_half_is_what_the_step_would_project_from_its_own_tokens(n: int) -> None:
    model = drafter()
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        first = model.layer.embedding_qkv(F.embedding(shift_left(ids, 1), model.embed_table))
        own = model.layer.embedding_qkv(F.embedding(shift_left(ids, n + 1), model.embed_table))
    assert torch.equal(shift_rows(first, n), own)  # the same rows, moved: bit for bit


@pytest.mark.parametrize("steps", [1, 4, T + 2])
def test_the_unroll_equals_every_step_projecting_its_own_tokens_through_whole_qkv_weights(steps: int) -> None:
    model = drafter()
    losses, grads = unroll(model, reference=False, steps=steps)
    ref_losses, ref_grads = unroll(model, reference=True, steps=steps)
    assert losses.shape == (steps,) and bool(losses[: T - 1].abs().min() > 0)  # past the end nothing is trained
    torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=0)
    assert set(grads) == set(ref_grads)
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-10, atol=1e-14, msg=name)


def test_the_comparison_fails_when_the_steps_read_their_tokens_one_position_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import engine.trainer.draft.model as model_module

    model = drafter()
    ref_losses, _ = unroll(model, reference=True, steps=3)
    monkeypatch.setattr(model_module, "shift_rows", lambda x, n: shift_rows(x, n + 1))
    off, _ = unroll(model, reference=False, steps=3)
    assert (off - ref_losses).abs().min() > 1e-6
