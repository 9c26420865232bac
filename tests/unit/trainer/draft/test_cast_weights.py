"""cast_weights_once: the TTT steps share one bf16 cast of the drafter's Linear weights (CPU, bf16 autocast).

What it changes is where the steps' gradients meet. A compiled TTT step casts its fp32 weights inside its graph,
so each step's backward hands each weight an fp32 gradient and autograd adds ``ttt_steps`` of them. Eager
autocast caches the cast and meets once already, so uncompiled the option changes nothing, bit for bit; cast once,
the compiled steps give what eager gives (to 1e-6 here, aot_eager). Against compiled per-step casts the losses
agree and the gradients differ by the bf16 sum of ``ttt_steps`` terms: each weight's to a relative norm of 1e-2
and a cosine of 0.9999 (measured 0.2 %).
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from typing import Any

import pytest
import torch

from engine.trainer.config import DRAFTER_FP8_MLP_COMPOSED, DRAFTER_FP8_OFF, from_dict
from engine.trainer.data.dispatch import IndexLedger
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.loss import soft_cross_entropy, total_loss
from engine.trainer.draft.model import (
    CAST_WEIGHTS,
    HEAD,
    LAYER_LINEARS,
    QKV,
    QKV_LINEARS,
    DraftConfig,
    Drafter,
    ttt_step,
)
from engine.trainer.draft.rows import trained_rows
from engine.trainer.run.worker import DrafterTraining, DrafterWorker, WorkerLinks, WorkerSettings
from engine.trainer.threads.compile import GuardedFunction, apply_dynamo_config, compile_guard
from engine.trainer.threads.control import ThreadControl
from engine.trainer.threads.health import HealthBoard
from engine.trainer.threads.metrics import EventLog
from engine.trainer.threads.queue import BoundedQueue

TTT_STEPS = 3
SEQ = 32
VOCAB = 128
DRAFT_VOCAB = 48


def drafter(embed_dtype: torch.dtype = torch.bfloat16) -> Drafter:
    cfg = DraftConfig(
        hidden_size=64,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
    )
    torch.manual_seed(0)
    embed = torch.randn(VOCAB, 64).to(embed_dtype)
    return Drafter(cfg, embed, torch.arange(DRAFT_VOCAB) * 2)


def batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    hidden3 = torch.randn(2, SEQ, 3 * 64, generator=g).to(torch.bfloat16)
    target_z = torch.randn(2, SEQ, DRAFT_VOCAB, generator=g) * 3
    mask = (torch.rand(2, SEQ, generator=g) > 0.2).float()
    return ids, hidden3, target_z, torch.logsumexp(target_z, -1), mask


def gradient_edges(model: Drafter, root: torch.Tensor) -> dict[str, int]:
    """Per parameter, how many edges of the autograd graph from ``root`` lead into it: the gradients autograd
    adds into its ``.grad`` (one edge: nothing to add)."""
    names = {id(p): n for n, p in model.named_parameters()}
    counts: dict[str, int] = {}
    seen: set[int] = set()
    todo = [root.grad_fn]
    while todo:
        node = todo.pop()
        for fn, _ in node.next_functions if node is not None else ():
            if fn is None:
                continue
            variable = getattr(fn, "variable", None)
            if variable is not None:
                counts[names[id(variable)]] = counts.get(names[id(variable)], 0) + 1
            elif id(fn) not in seen:
                seen.add(id(fn))
                todo.append(fn)
    return counts


def losses_and_grads(
    model: Drafter,
    weight_dtype: torch.dtype | None,
    step_fn: Callable[..., Any] | None = None,
    grad_checkpointing: bool = False,
    fp8: str = DRAFTER_FP8_OFF,
    fp8_layouts: Callable[..., Any] | None = None,
    fp8_mlp: str = DRAFTER_FP8_MLP_COMPOSED,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, int]]:
    ids, hidden3, target_z, target_lse, mask = batch()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses, _, _ = model(
            hidden3,
            ids,
            target_z,
            target_lse,
            mask,
            ttt_steps=TTT_STEPS,
            attention=TTTAttention("sdpa", compiled=False),
            loss_fn=soft_cross_entropy,
            step_fn=step_fn,
            loss_mask=mask,
            grad_checkpointing=grad_checkpointing,
            weight_dtype=weight_dtype,
            fp8=fp8,
            fp8_layouts=fp8_layouts,
            fp8_mlp=fp8_mlp,
        )
    total = total_loss(losses)
    edges = gradient_edges(model, total)
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads, edges


def linear_names() -> list[str]:
    return [f"layer.{n}.weight" for n in LAYER_LINEARS] + [f"{HEAD}.weight"]


def test_uncompiled_cast_once_changes_nothing_bit_for_bit_but_the_stacked_qkv_gradient_sum() -> None:
    """Eager autocast caches each parameter's cast for the whole unroll: one cast already, so equal bit for bit.
    q/k/v run stacked (``qkv_weight``, not a parameter): autocast casts the stack at every use without the cache,
    so their gradients meet in fp32 there and in bf16 cast once, as compiled steps do (a bf16 sum away)."""
    model = drafter()
    per_step, grads_per_step, _ = losses_and_grads(model, None)
    once, grads_once, _ = losses_and_grads(model, torch.bfloat16)
    assert torch.equal(per_step, once)
    assert set(grads_once) == set(grads_per_step)
    stacked = {f"layer.{n}.weight" for n in QKV_LINEARS}
    for name in grads_once:
        assert grads_once[name].dtype == torch.float32  # the parameters and their gradients stay fp32
        if name in stacked:
            a, b = grads_per_step[name], grads_once[name]
            rel = ((a - b).norm() / a.norm()).item()
            cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
            assert rel < 1e-2 and cos > 0.9999, (name, rel, cos)
        else:
            assert torch.equal(grads_per_step[name], grads_once[name]), name


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_cast_once_gives_eager_numerics_and_per_step_casts_a_bf16_sum_away() -> None:
    apply_dynamo_config()
    model = drafter()
    eager, grads_eager, _ = losses_and_grads(model, torch.bfloat16)
    step_fn = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="aot_eager")
    with compile_guard():
        once, grads_once, _ = losses_and_grads(model, torch.bfloat16, step_fn)
        per_step, grads_per_step, _ = losses_and_grads(model, None, step_fn)
    torch.testing.assert_close(once, eager, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(per_step, once, rtol=1e-3, atol=1e-3)
    for name in linear_names():
        torch.testing.assert_close(grads_once[name], grads_eager[name], rtol=1e-6, atol=1e-8)
        a, b = grads_per_step[name], grads_once[name]
        rel = ((a - b).norm() / a.norm()).item()
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        assert rel < 1e-2 and cos > 0.9999, (name, rel, cos)


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_steps_hand_each_linear_weight_one_gradient_cast_once_instead_of_one_per_ttt_step() -> None:
    """The point of it: compiled per-step casts hand each weight ``ttt_steps`` fp32 gradients to add (on the
    H200, TTT 7: six additions for each of 12 tensors a step, 72 kernels; the 8 Linears' 48 go); one cast hands
    one."""
    apply_dynamo_config()
    model = drafter()
    step_fn = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="aot_eager")
    with compile_guard():
        _, _, per_step = losses_and_grads(model, None, step_fn)
        _, _, once = losses_and_grads(model, torch.bfloat16, step_fn)
    stacked = {f"layer.{n}.weight" for n in QKV_LINEARS}
    for name in linear_names():
        # q/k/v also meet once before the steps: the embedding half of their matmul runs once an unroll.
        assert per_step[name] == TTT_STEPS + (name in stacked), (name, per_step)
        assert once[name] == 1, (name, once)
    # The norms are not cast (fp32, small): the hidden state's arrives per step, the embeddings' once.
    assert once["layer.hidden_norm.weight"] == per_step["layer.hidden_norm.weight"] == TTT_STEPS
    assert once["layer.input_layernorm.weight"] == per_step["layer.input_layernorm.weight"] == 1
    assert per_step["fc.weight"] == once["fc.weight"] == 1  # fc runs once, before the steps


def test_cast_weights_are_the_linears_in_the_asked_dtype_and_carry_gradients_to_the_parameters() -> None:
    model = drafter()
    weights = model.cast_weights(torch.bfloat16)
    assert sorted(weights) == sorted(CAST_WEIGHTS)
    assert sorted([*QKV_LINEARS, *(n for n in CAST_WEIGHTS if n != QKV)]) == sorted([*LAYER_LINEARS, HEAD])
    for name, w in weights.items():
        if name == QKV:  # [W_q; W_k; W_v]
            p = torch.cat([getattr(model.layer, n).weight for n in QKV_LINEARS])
        else:
            p = model.lm_head.weight if name == HEAD else getattr(model.layer, name).weight
        assert w.dtype == torch.bfloat16 and w.shape == p.shape and w.requires_grad
        assert torch.equal(w, p.to(torch.bfloat16))
    w = weights[QKV].float()
    w.sum().backward()  # each of q, k and v gets its rows' gradient
    for n in QKV_LINEARS:
        g = getattr(model.layer, n).weight.grad
        assert g is not None and torch.equal(g, torch.ones_like(g))


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_step_takes_fresh_cast_weights_every_step_without_recompiling() -> None:
    """The cast tensors are new each training step: graph inputs, not constants, so nothing compiles again."""
    apply_dynamo_config()
    step_fn = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="aot_eager")
    compiles: list[object] = []
    step_fn.listeners.append(compiles.append)
    model = drafter()
    with compile_guard():
        losses_and_grads(model, torch.bfloat16, step_fn)
    step_fn.mark_warm()
    graphs = step_fn.graph_count()
    assert graphs is not None and graphs >= 1
    with compile_guard():
        losses_and_grads(model, torch.bfloat16, step_fn)
    assert step_fn.graph_count() == graphs
    assert compiles == []  # no recompile event after warm-up


def cpu_worker(model: Drafter, settings: WorkerSettings, autocast: torch.dtype | None) -> DrafterWorker:
    """A drafter worker on the CPU, its step and attention eager, as the engine builds one (no thread started)."""
    opt = torch.optim.AdamW(model.trainable_parameters(), lr=1e-3)
    training = DrafterTraining(
        model,
        torch.device("cpu"),
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
        TTTAttention("sdpa", compiled=False),
        GuardedFunction(ttt_step, compiled=False, name="ttt_step"),
        hidden_dtype=autocast or torch.float32,
        autocast_dtype=autocast,
    )
    events = EventLog(None, stdout=io.StringIO())
    control = ThreadControl(events, HealthBoard(events, stall_after_s=60, starve_after_s=60), "stop")
    return DrafterWorker("drafter0", 0, training, settings, WorkerLinks(BoundedQueue(1), control, IndexLedger()))


@pytest.mark.parametrize("packing", [False, True])
def test_the_warm_up_batch_trains_fewer_rows_than_the_batch_holds_in_every_ttt_step(packing: bool) -> None:
    """The trained rows' padded counts stay below B*T, as real batches' do: a warm-up count stepped over B*T
    compiled its TTT step again at the first real batch on an H100 (draft/rows.py)."""
    settings = WorkerSettings.from_config(from_dict({"batch_size": 4, "ttt_steps": 7, "packing": packing}))
    worker = cpu_worker(drafter(), settings, torch.bfloat16)
    batch = worker.synthetic_batch(64)
    positions = 4 * 64
    rows = trained_rows(batch.position_mask, batch.documents, 7)
    sizes = [len(index) for index in rows.index]
    assert all(size < positions for size in sizes), sizes
    assert min(rows.counts) > positions // 2  # most positions still train: the warm-up's graphs see real work
    torch.testing.assert_close(batch.loss_mask, batch.position_mask)  # equal, and two tensors
    assert batch.loss_mask is not batch.position_mask


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize(
    ("compiled", "head_positions", "shares"),
    [(True, "trained", 2), (False, "trained", 1), (True, "all", 1)],
    ids=["compiled-rows", "eager", "compiled-every-position"],
)
def test_warm_up_trains_row_counts_on_both_sides_of_half_the_batch_where_a_compiled_step_takes_them(
    compiled: bool, head_positions: str, shares: int
) -> None:
    """Where the compiled steps take a row count, warm-up runs every bucket twice: with most positions trained and
    with few, so a graph whose count guard real batches on the other side would fail is made in warm-up (at batch 8
    on an H100 every TTT step compiled again at the first real batch after a warm-up on one side only)."""
    settings = WorkerSettings.from_config(
        from_dict({"batch_size": 4, "ttt_steps": 7, "buckets": [SEQ], "head_positions": head_positions})
    )
    worker = cpu_worker(drafter(), settings, torch.bfloat16)
    if compiled:
        step_fn = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="aot_eager")
        worker.training = dataclasses.replace(worker.training, step_fn=step_fn)
    seen: list[tuple[int, tuple[int, ...]]] = []
    forward_backward = worker.forward_backward

    def spy(batch: Any) -> Any:
        counts = trained_rows(batch.position_mask, batch.documents, 7).counts
        seen.append((batch.bucket, counts))
        return forward_backward(batch)

    worker.forward_backward = spy  # type: ignore[method-assign]
    worker.warm_up()
    assert [bucket for bucket, _ in seen] == [SEQ] * shares
    counts = [c for _, c in seen]
    half = 4 * SEQ // 2
    assert min(counts[0]) > half, counts  # most positions train: the graphs see real work
    if shares == 2:
        assert max(counts[1]) < half, counts  # and few: the other side of any count between them
    if compiled and head_positions == "trained":
        assert worker.training.step_fn.graph_count() == 7  # one graph a TTT step took both (eager CPU backend)
        assert worker.training.step_fn.events == []


def test_checkpointed_steps_recompute_on_the_same_cast_weights() -> None:
    """grad_checkpointing recomputes each step in the backward, after the forward returned: it gets the cast
    weights as arguments, so the recomputed steps' gradients reach the same cast (and equal the stored run's)."""
    model = drafter()
    stored, grads_stored, _ = losses_and_grads(model, torch.bfloat16)
    recomputed, grads_recomputed, edges = losses_and_grads(model, torch.bfloat16, grad_checkpointing=True)
    assert torch.equal(stored, recomputed)
    for name in linear_names():
        torch.testing.assert_close(grads_recomputed[name], grads_stored[name], rtol=0, atol=0)
        assert edges[name] == 1


@pytest.mark.parametrize(
    ("value", "autocast", "passed"),
    [(True, torch.bfloat16, torch.bfloat16), (False, torch.bfloat16, None), (True, None, None)],
    ids=["on", "off", "on-without-autocast"],
)
def test_the_worker_hands_the_drafter_its_autocast_dtype_to_cast_once(
    value: bool, autocast: torch.dtype | None, passed: torch.dtype | None
) -> None:
    """From the config key to the drafter's forward: the worker asks for the cast in its autocast dtype, and for
    none where it has no autocast (float32 on the CPU) or the key is off."""
    settings = WorkerSettings.from_config(from_dict({"cast_weights_once": value, "batch_size": 2}))
    assert settings.cast_weights_once is value
    model = drafter(autocast or torch.float32)
    worker = cpu_worker(model, settings, autocast)
    seen: list[torch.dtype | None] = []
    forward = model.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs["weight_dtype"])
        return forward(*args, **kwargs)

    model.forward = spy  # type: ignore[method-assign]
    with compile_guard():  # as the worker's warm-up runs it
        worker.forward_backward(worker.synthetic_batch(SEQ))
    assert seen == [passed]
    assert all(p.grad is not None for p in model.trainable_parameters())
