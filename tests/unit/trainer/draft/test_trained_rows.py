"""head_positions = "trained": the head and the loss run on the rows each TTT step trains (draft/rows.py).

The same sums over the same terms as the head over every position: the losses, the accuracy counts and every
parameter's gradient agree (float32, to rounding), for the soft cross-entropy in both normalisations, for the LK
loss, on packed rows, and compiled (one graph per step for every row count: the row dimension is dynamic).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.trainer.config import (
    DRAFTER_FP8_OFF,
    DRAFTER_FP8_ROWWISE,
    LOSS_LK_LAMBDA,
    LOSS_MEAN_ALL,
    LOSS_MEAN_MASKED,
    LOSS_SOFT_CE,
)
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.fp8 import cpu_rowwise_supported
from engine.trainer.draft.loss import loss_function, total_loss
from engine.trainer.draft.model import DraftConfig, Drafter, shift_left, ttt_step
from engine.trainer.draft.rows import ROW_OFFSET, ROW_QUANTUM, step_masks, trained_rows
from engine.trainer.threads.compile import GuardedFunction, apply_dynamo_config, compile_guard

TTT_STEPS = 3
SEQ = 32
VOCAB = 128
DRAFT_VOCAB = 6  # small: an untrained drafter agrees with the target often enough to count hits


def drafter(draft_vocab: int = DRAFT_VOCAB) -> Drafter:
    cfg = DraftConfig(
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        draft_vocab_size=draft_vocab,
    )
    torch.manual_seed(0)
    return Drafter(cfg, torch.randn(VOCAB, 64), torch.arange(draft_vocab) * 2)


def batch(seed: int = 1, keep: float = 0.6, packed: bool = False, draft_vocab: int = DRAFT_VOCAB) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    target_z = torch.randn(2, SEQ, draft_vocab, generator=g) * 3
    loss_mask = (torch.rand(2, SEQ, generator=g) < 0.8).float()
    position_mask = loss_mask * (torch.rand(2, SEQ, generator=g) < keep).float()
    documents = (torch.arange(SEQ) >= SEQ // 3).long().expand(2, SEQ).contiguous() if packed else None
    return {
        "hidden3": torch.randn(2, SEQ, 3 * 64, generator=g),
        "input_ids": ids,
        "target_logits": target_z,
        "target_lse": torch.logsumexp(target_z, -1),
        "position_mask": position_mask,
        "loss_mask": loss_mask,
        "documents": documents,
    }


def unroll(
    model: Drafter, b: dict[str, Any], rows: bool, loss_fn: Any, step_fn: Any = None, fp8: str = DRAFTER_FP8_OFF
) -> tuple[Any, ...]:
    model.zero_grad(set_to_none=True)
    chosen = trained_rows(b["position_mask"], b["documents"], TTT_STEPS) if rows else None
    losses, correct, counts = model(
        b["hidden3"],
        b["input_ids"],
        b["target_logits"],
        b["target_lse"],
        b["position_mask"],
        ttt_steps=TTT_STEPS,
        attention=TTTAttention("sdpa"),
        loss_fn=loss_fn,
        loss_mask=b["loss_mask"],
        documents=b["documents"],
        step_fn=step_fn,
        fp8=fp8,
        rows=chosen,
    )
    total_loss(losses).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), correct.detach(), counts.detach(), grads


def assert_same(a: tuple[Any, ...], b: tuple[Any, ...], tol: float = 1e-5) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=tol, atol=tol)
    assert torch.equal(a[1], b[1]), (a[1], b[1])
    assert torch.equal(a[2], b[2]), (a[2], b[2])
    assert a[3].keys() == b[3].keys() and len(a[3]) >= 8
    for name in a[3]:
        g0, g1 = a[3][name], b[3][name]
        rel = float((g1 - g0).norm() / g0.norm().clamp_min(1e-30))
        assert rel < tol, f"{name}: relative gradient difference {rel:.2e}"


@pytest.mark.parametrize(
    ("mean", "kind", "packed"),
    [
        (LOSS_MEAN_ALL, LOSS_SOFT_CE, False),
        (LOSS_MEAN_MASKED, LOSS_SOFT_CE, False),
        (LOSS_MEAN_ALL, LOSS_SOFT_CE, True),
        (LOSS_MEAN_ALL, LOSS_LK_LAMBDA, False),
    ],
)
def test_trained_rows_give_the_losses_counts_and_gradients_of_every_row(mean: str, kind: str, packed: bool) -> None:
    model = drafter()
    b = batch(packed=packed)
    loss_fn = loss_function(mean, kind)
    every = unroll(model, b, rows=False, loss_fn=loss_fn)
    some = unroll(model, b, rows=True, loss_fn=loss_fn)
    assert float(every[0].abs().min()) > 0 and float(every[1].sum()) > 0  # something was trained and counted
    assert_same(every, some)


def test_rows_are_the_shifted_trained_positions_padded_with_weight_zero() -> None:
    b = batch(packed=True)
    rows = trained_rows(b["position_mask"], b["documents"], TTT_STEPS)
    masks = step_masks(b["position_mask"], b["documents"], TTT_STEPS)
    for i in range(TTT_STEPS):
        shift = i + 1
        want = shift_left(b["position_mask"], shift) > 0
        inside = b["documents"][:, shift:] == b["documents"][:, :-shift]
        want[:, : SEQ - shift] &= inside
        assert torch.equal(masks[i], want)
        count = int(want.sum())
        index, weight = rows.index[i], rows.weight[i]
        assert rows.counts[i] == count
        # padded to 8 more than a multiple of 16: never 0 or 1, never a static size such as B*T
        assert index.numel() % ROW_QUANTUM == ROW_OFFSET and count <= index.numel() < count + ROW_QUANTUM
        assert torch.equal(index[:count], want.flatten().nonzero().squeeze(1))
        assert torch.equal(weight, (torch.arange(index.numel()) < count).float())
        # every trained position's target lies in its own sequence
        assert bool(((index[:count] % SEQ) + shift < SEQ).all())


def test_an_all_trained_batch_pads_its_rows_past_the_batch_not_to_its_size() -> None:
    """The warm-up's synthetic batch trains every position: counts B*(T - shift), which padding to a multiple of 16
    took to exactly B*T for the first steps, and the graphs compiled at that count were compiled again on an H100.
    Buckets need not be multiples of 16: a B*T of 8 more than one is stepped over too."""
    for b, t in ((4, 2048), (2, 32), (1, 128), (3, 256), (2, 100), (1, 1000), (1, 24)):
        rows = trained_rows(torch.ones(b, t), None, 7)
        sizes = [i.numel() for i in rows.index]
        assert rows.counts == tuple(b * (t - s) for s in range(1, 8))
        assert all(n % 16 == 8 and n != b * t for n in sizes), (b, t, sizes)


def test_rows_without_nonzero_static_are_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.5's CUDA has no nonzero_static kernel: the rows are then made by nonzero and padded."""
    b = batch(packed=True)
    want = trained_rows(b["position_mask"], b["documents"], TTT_STEPS)

    def missing(*_args: Any, **_kwargs: Any) -> torch.Tensor:
        raise NotImplementedError("Could not run 'aten::nonzero_static' with arguments from the 'CUDA' backend")

    monkeypatch.setattr(torch, "nonzero_static", missing)
    got = trained_rows(b["position_mask"], b["documents"], TTT_STEPS)
    assert got.counts == want.counts
    for a, c in zip(want.index, got.index, strict=True):
        assert torch.equal(a, c)


def test_a_step_with_nothing_to_train_counts_zero_and_gives_no_gradient() -> None:
    model = drafter()
    b = batch()
    b["position_mask"] = torch.zeros_like(b["position_mask"])
    loss_fn = loss_function(LOSS_MEAN_ALL, LOSS_SOFT_CE)
    every = unroll(model, b, rows=False, loss_fn=loss_fn)
    some = unroll(model, b, rows=True, loss_fn=loss_fn)
    assert float(some[0].abs().sum()) == 0.0 and float(some[1].sum()) == 0.0
    assert torch.equal(every[2], some[2])  # the accuracy denominator still counts the loss-masked positions
    assert all(float(g.abs().sum()) == 0.0 for g in some[3].values())


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_steps_take_every_row_count_with_one_graph_each() -> None:
    apply_dynamo_config()
    torch._dynamo.reset()
    model = drafter()
    loss_fn = loss_function(LOSS_MEAN_ALL, LOSS_SOFT_CE)
    step = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="aot_eager")
    with compile_guard():
        unroll(model, batch(seed=1, keep=0.9), rows=True, loss_fn=loss_fn, step_fn=step)
    step.mark_warm()
    graphs, signatures = step.graph_count(), len(step._seen)
    for seed, keep in ((2, 0.3), (3, 0.6), (4, 0.05)):
        b = batch(seed=seed, keep=keep)
        got = unroll(model, b, rows=True, loss_fn=loss_fn, step_fn=step)
        assert_same(unroll(model, b, rows=False, loss_fn=loss_fn), got)
    assert step.graph_count() == graphs, "a new row count compiled another graph"
    # and is no new signature to the guard (which would take the compile lock alone for every batch)
    assert len(step._seen) == signatures, "a new row count made another signature"
    assert step.events == [], step.events


@pytest.mark.skipif(not cpu_rowwise_supported(), reason="this torch's CPU _scaled_mm takes no row-wise scales")
def test_trained_rows_with_the_drafter_gemms_in_fp8() -> None:
    """Row-wise scales are per token (a gathered row quantises as it did in place); the head's weight gradient
    scales each feature over the rows it is given, which no longer include the untrained ones: with activations of
    one scale, as here and in training, that moves only values near e4m3's smallest (the scales are powers of two),
    and the numbers agree to 1e-4."""
    model = drafter(draft_vocab=16)
    b = batch(draft_vocab=16)
    loss_fn = loss_function(LOSS_MEAN_ALL, LOSS_SOFT_CE)
    every = unroll(model, b, rows=False, loss_fn=loss_fn, fp8=DRAFTER_FP8_ROWWISE)
    some = unroll(model, b, rows=True, loss_fn=loss_fn, fp8=DRAFTER_FP8_ROWWISE)
    assert_same(every, some, tol=1e-4)
