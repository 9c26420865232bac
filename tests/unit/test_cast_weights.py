"""cast_weights_once: the TTT steps share one bf16 cast of the drafter's Linear weights (CPU, bf16 autocast).

What it changes is where the steps' gradients meet. A compiled TTT step casts its fp32 weights inside its graph,
so each step's backward hands each weight an fp32 gradient and autograd adds ``ttt_steps`` of them (eager
autocast caches the cast and meets once already). Cast once, the steps' gradients meet at the one cast, in
bf16. The forward is the same computation (autocast's cast and ``Tensor.to`` round alike), so the losses are
equal; the gradients differ by the bf16 sum of ``ttt_steps`` terms: each weight's to a relative norm of 1e-2
and a cosine of 0.9999 against the per-step casts.
"""

from __future__ import annotations

import pytest
import torch

from engine.trainer.config import from_dict
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.loss import soft_cross_entropy, total_loss
from engine.trainer.draft.model import HEAD, LAYER_LINEARS, DraftConfig, Drafter, ttt_step
from engine.trainer.run.worker import WorkerSettings
from engine.trainer.threads.compile import GuardedFunction, apply_dynamo_config, compile_guard

TTT_STEPS = 3
SEQ = 32
VOCAB = 128
DRAFT_VOCAB = 48


def drafter() -> Drafter:
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
    embed = torch.randn(VOCAB, 64).to(torch.bfloat16)
    return Drafter(cfg, embed, torch.arange(DRAFT_VOCAB) * 2)


def batch() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    hidden3 = torch.randn(2, SEQ, 3 * 64, generator=g).to(torch.bfloat16)
    target_p = torch.softmax(torch.randn(2, SEQ, DRAFT_VOCAB, generator=g) * 3, -1)
    mask = (torch.rand(2, SEQ, generator=g) > 0.2).float()
    return ids, hidden3, target_p, mask


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
    step_fn: GuardedFunction | None = None,
    grad_checkpointing: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, int]]:
    ids, hidden3, target_p, mask = batch()
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        losses, _, _ = model(
            hidden3,
            ids,
            target_p,
            mask,
            ttt_steps=TTT_STEPS,
            attention=TTTAttention("sdpa", compiled=False),
            loss_fn=soft_cross_entropy,
            step_fn=step_fn,
            loss_mask=mask,
            grad_checkpointing=grad_checkpointing,
            weight_dtype=weight_dtype,
        )
    total = total_loss(losses)
    edges = gradient_edges(model, total)
    total.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses.detach(), grads, edges


def linear_names() -> list[str]:
    return [f"layer.{n}.weight" for n in LAYER_LINEARS] + [f"{HEAD}.weight"]


def test_cast_once_gives_the_same_losses_and_the_gradients_within_a_bf16_sum() -> None:
    model = drafter()
    per_step, grads_per_step, _ = losses_and_grads(model, None)
    once, grads_once, _ = losses_and_grads(model, torch.bfloat16)
    assert torch.equal(per_step, once)
    assert set(grads_once) == set(grads_per_step)
    for name in grads_once:
        a, b = grads_per_step[name].float(), grads_once[name].float()
        assert grads_once[name].dtype == torch.float32  # the parameters and their gradients stay fp32
        rel = ((a - b).norm() / a.norm()).item()
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        assert rel < 1e-2 and cos > 0.9999, (name, rel, cos)


def test_compiled_steps_hand_each_linear_weight_one_gradient_cast_once_instead_of_one_per_ttt_step() -> None:
    """The point of it: compiled per-step casts hand each weight ``ttt_steps`` fp32 gradients to add (the 72
    fp32 additions a step of the H200 profile); one cast hands one."""
    apply_dynamo_config()
    model = drafter()
    step_fn = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="aot_eager")
    with compile_guard():
        _, _, per_step = losses_and_grads(model, None, step_fn)
        _, _, once = losses_and_grads(model, torch.bfloat16, step_fn)
    for name in linear_names():
        assert per_step[name] == TTT_STEPS, (name, per_step)
        assert once[name] == 1, (name, once)
    # The norms are not cast (fp32, small): their gradients still arrive per step.
    assert once["layer.input_layernorm.weight"] == TTT_STEPS
    assert per_step["fc.weight"] == once["fc.weight"] == 1  # fc runs once, before the steps


def test_cast_weights_are_the_linears_in_the_asked_dtype_and_carry_gradients_to_the_parameters() -> None:
    model = drafter()
    weights = model.cast_weights(torch.bfloat16)
    assert sorted(weights) == sorted([*LAYER_LINEARS, HEAD])
    for name, w in weights.items():
        p = model.lm_head.weight if name == HEAD else getattr(model.layer, name).weight
        assert w.dtype == torch.bfloat16 and w.shape == p.shape and w.requires_grad
        assert torch.equal(w, p.to(torch.bfloat16))


def test_a_compiled_step_takes_the_cast_weights_with_one_graph_per_step_shape() -> None:
    """The compiled TTT step (aot_eager on the CPU) runs on the cast weights and equals the eager step; a second
    training step compiles nothing new (fresh cast tensors each step are inputs, not constants)."""
    apply_dynamo_config()
    step_fn = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="aot_eager")
    compiles: list[object] = []
    step_fn.listeners.append(compiles.append)
    model = drafter()
    eager, grads_eager, _ = losses_and_grads(model, torch.bfloat16)
    with compile_guard():
        compiled, grads_compiled, _ = losses_and_grads(model, torch.bfloat16, step_fn)
    step_fn.mark_warm()
    graphs = step_fn.graph_count()
    assert graphs is not None and graphs >= 1
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)
    for name in linear_names():
        a, b = grads_eager[name], grads_compiled[name]
        assert ((a - b).norm() / a.norm()).item() < 2e-2, name
    with compile_guard():
        losses_and_grads(model, torch.bfloat16, step_fn)
    assert step_fn.graph_count() == graphs
    assert compiles == []  # no recompile event after warm-up


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


@pytest.mark.parametrize("value", [False, True])
def test_the_config_key_reaches_the_workers(value: bool) -> None:
    cfg = from_dict({"cast_weights_once": value})
    assert WorkerSettings.from_config(cfg).cast_weights_once is value
