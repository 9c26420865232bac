"""drafter_fp8: the drafter's Linear GEMMs (forward, grad_input, grad_weight) as row-wise scaled e4m3 matmuls (CPU).

What pins the numerics: each GEMM equals an emulation that rounds its operands to e4m3 with one power-of-two scale
per row along that GEMM's reduction dimension and multiplies in float32 (to the bf16 rounding of the output),
while the same emulation with the scales along the other axis is far off; and each GEMM's error against float32
sits in e4m3's band (measured 3.8 % relative on gaussian operands, bf16's is 0.29 %), so a GEMM that silently ran
in bf16 would fall below it. ``rowwise_gw_hp`` keeps the weight gradient in bf16's band.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from test_cast_weights import drafter  # same folder: pytest puts it on sys.path
from test_cast_weights import losses_and_grads as cast_unroll

from engine.trainer.config import DRAFTER_FP8_ROWWISE, DRAFTER_FP8_ROWWISE_GW_HP
from engine.trainer.draft import model as draft_model
from engine.trainer.draft.fp8 import (
    Fp8Weight,
    fp8_linear,
    fp8_weight,
    input_layouts,
    misaligned,
    quantize_rows,
    weight_layouts,
)
from engine.trainer.draft.model import FC, FC_INPUT, FP8_WEIGHTS, Drafter, ttt_step
from engine.trainer.threads.compile import GuardedFunction, apply_dynamo_config, compile_guard

E4M3_MAX = 448.0
FP8_BAND = (0.02, 0.06)  # relative error norm of an e4m3 GEMM against float32 (gaussian operands: 0.038)
BF16_BELOW = 0.006  # a bf16 GEMM's (0.0029)


@pytest.fixture(autouse=True, scope="module")
def two_torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(min(before, 2))
    yield
    torch.set_num_threads(before)


def emulate(a: torch.Tensor, b: torch.Tensor, axis_a: int, axis_b: int) -> torch.Tensor:
    """``a @ b`` with a rounded to e4m3 by a power-of-two scale per slice along ``axis_a`` (the amax taken over that
    axis), b likewise, multiplied in float32: written apart from the code it checks."""

    def rounded(x: torch.Tensor, axis: int) -> torch.Tensor:
        amax = x.abs().amax(dim=axis, keepdim=True).clamp_min(1e-12)
        scale = 2.0 ** torch.ceil(torch.log2(amax / E4M3_MAX))
        return (x / scale).to(torch.float8_e4m3fn).float() * scale

    return rounded(a.float(), axis_a) @ rounded(b.float(), axis_b)


def operands(tokens: int = 200, d_in: int = 256, d_out: int = 128) -> tuple[torch.Tensor, ...]:
    """x, W and dy with magnitudes spread over six decades across tokens and across features, so that a scale
    taken along the wrong axis flushes the small ones below e4m3's range (the emulation comparison then shows it)."""
    g = torch.Generator().manual_seed(0)

    def spread(*shape: int) -> torch.Tensor:
        return 10 ** (torch.rand(*shape, generator=g) * 6 - 3)

    x = torch.randn(tokens, d_in, generator=g) * spread(tokens, 1) * spread(1, d_in)
    w = torch.randn(d_out, d_in, generator=g) * spread(d_out, 1) * spread(1, d_in) * 0.02
    dy = torch.randn(tokens, d_out, generator=g) * spread(tokens, 1) * spread(1, d_out)
    return x.to(torch.bfloat16), w.to(torch.bfloat16), dy.to(torch.bfloat16)


def run_fp8(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, *, grad_weight_fp8: bool) -> tuple[torch.Tensor, ...]:
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fp8_linear(xr, fp8_weight(wr, grad_weight_fp8=grad_weight_fp8))
    out.backward(dy)
    assert xr.grad is not None and wr.grad is not None
    return out, xr.grad, wr.grad


def worst_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest relative error norm of ``got`` over any row or any column of ``want`` (magnitudes spread over
    decades: a small row's error counts as much as a large one's)."""
    got, want = got.detach().float(), want.detach().float()
    err = got - want
    return float(max((err.norm(dim=1) / want.norm(dim=1)).max(), (err.norm(dim=0) / want.norm(dim=0)).max()))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    return float((got - want).norm() / want.norm())


def test_each_gemm_is_e4m3_scaled_per_row_along_its_reduction_and_not_along_the_other_axis() -> None:
    x, w, dy = operands()
    out, dx, dw = run_fp8(x, w, dy, grad_weight_fp8=True)
    # forward x @ W^T: x per token and W per output row, both over the input features.
    gemms = {
        "forward": (out, emulate(x, w.t(), 1, 0), emulate(x, w.t(), 0, 1)),
        "grad_input": (dx, emulate(dy, w, 1, 0), emulate(dy, w, 0, 1)),  # over the output features
        "grad_weight": (dw, emulate(dy.t(), x, 1, 0), emulate(dy.t(), x, 0, 1)),  # over the tokens
    }
    for name, (got, right_axis, wrong_axis) in gemms.items():
        assert got.dtype == torch.bfloat16
        right, wrong = worst_error(got, right_axis), worst_error(wrong_axis, got)
        assert right < 2**-7, (name, right)  # bf16's rounding of the output; measured 0.0023-0.0030
        assert wrong > 0.5, (name, wrong)  # the check tells the axes apart: measured 4.9e3 to inf


def test_fp8_gemms_sit_in_e4m3_error_band_against_float32_and_gw_hp_keeps_the_weight_gradient_in_bf16() -> None:
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(200, 256, generator=g), torch.randn(128, 256, generator=g) * 0.02, torch.randn(200, 128)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xr @ wr.t()).backward(dy)
    want = (x @ w.t(), xr.grad, wr.grad)
    bf16 = [t.to(torch.bfloat16) for t in (x, w, dy)]
    rowwise = [relative_error(a, b) for a, b in zip(run_fp8(*bf16, grad_weight_fp8=True), want, strict=True)]
    gw_hp = [relative_error(a, b) for a, b in zip(run_fp8(*bf16, grad_weight_fp8=False), want, strict=True)]
    assert all(FP8_BAND[0] < e < FP8_BAND[1] for e in rowwise), rowwise  # measured 0.038, 0.038, 0.038
    assert all(FP8_BAND[0] < e < FP8_BAND[1] for e in gw_hp[:2]), gw_hp
    assert gw_hp[2] < BF16_BELOW, gw_hp  # measured 0.0029


def test_a_token_count_off_the_16_grid_pads_the_weight_gradient_with_zero_tokens() -> None:
    x, w, dy = operands(tokens=37)
    _, _, dw = run_fp8(x, w, dy, grad_weight_fp8=True)
    assert worst_error(dw, emulate(dy.t(), x, 1, 0)) < 2**-7


def test_the_weight_keeps_its_dtype_and_gets_its_gradient_through_the_cast() -> None:
    w = (torch.randn(32, 64) * 0.02).requires_grad_()
    cast = w.to(torch.bfloat16)
    fw = fp8_weight(cast, grad_weight_fp8=True)
    assert fw.rows.dtype == fw.cols.dtype == torch.float8_e4m3fn
    assert fw.rows.shape == (32, 64) and fw.cols.shape == (64, 32) and fw.cols.is_contiguous()
    assert fw.row_scale.shape == (1, 32) and fw.col_scale.shape == (1, 64)
    fp8_linear(torch.randn(4, 16, 64), fw).sum().backward()
    assert w.grad is not None and w.grad.dtype == torch.float32 and w.grad.shape == w.shape


def test_an_input_that_needs_no_gradient_gets_no_fp8_input_gradient_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """fc's input (the target's states) takes no gradient: its backward runs the weight gradient's GEMM only."""
    from engine.trainer.draft import fp8 as fp8_module

    calls: list[tuple[int, ...]] = []
    real = fp8_module._scaled_mm

    def counting(a: torch.Tensor, b_t: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(a.shape))
        return real(a, b_t, sa, sb)

    monkeypatch.setattr(fp8_module, "_scaled_mm", counting)
    x, w, dy = operands()
    weight = w.detach().to(torch.bfloat16).requires_grad_()
    fp8_linear(x.detach(), fp8_weight(weight, grad_weight_fp8=True)).backward(dy)
    assert len(calls) == 2 and weight.grad is not None  # forward and grad_weight: no grad_input GEMM
    calls.clear()
    xg = x.detach().requires_grad_()
    fp8_linear(xg, fp8_weight(weight, grad_weight_fp8=True)).backward(dy)
    assert len(calls) == 3 and xg.grad is not None


@pytest.mark.parametrize("grad_weight_fp8", [True, False])
@pytest.mark.parametrize("tokens", [37, 48])
def test_an_input_quantised_ahead_gives_the_same_output_and_weight_gradient_bit_for_bit(
    grad_weight_fp8: bool, tokens: int
) -> None:
    """fc's input comes quantised with the weights (input_layouts, in the engine's compiled call): the GEMMs and
    their results are the ones quantising it in place gives, tokens off the 16 grid (37) or on it (48) alike."""
    x, w, dy = operands(tokens=tokens)
    results = []
    for ahead in (False, True):
        weight = w.detach().clone().requires_grad_()
        fw = fp8_weight(weight, grad_weight_fp8=grad_weight_fp8)
        if ahead:
            fw = fw._replace(fixed_input=input_layouts(x))
        out = fp8_linear(x.detach(), fw)
        out.backward(dy)
        assert weight.grad is not None
        results.append((out, weight.grad))
    (out_a, grad_a), (out_b, grad_b) = results
    assert out_b.shape == (tokens, w.shape[0]) and out_b.dtype == torch.bfloat16
    assert torch.equal(out_a, out_b) and torch.equal(grad_a, grad_b)
    assert grad_b.abs().sum() > 0  # a gradient, not zeros


def test_input_layouts_pad_the_tokens_with_zeros_and_scale_per_token_and_per_feature() -> None:
    x, _, _ = operands(tokens=37, d_in=64)
    rows, row_scale, cols, col_scale = input_layouts(x)
    assert [tuple(t.shape) for t in (rows, row_scale, cols, col_scale)] == [(48, 64), (48, 1), (64, 48), (1, 64)]
    assert rows.dtype == cols.dtype == torch.float8_e4m3fn and cols.is_contiguous()
    assert bits(rows[37:]).eq(0).all() and bits(cols[:, 37:]).eq(0).all()  # the zero tokens add nothing
    want_rows, want_row_scale = quantize_rows(x)
    assert torch.equal(bits(rows[:37]), bits(want_rows)) and torch.equal(row_scale[:37], want_row_scale)
    padded = torch.cat([x, x.new_zeros(11, 64)])
    want_cols, want_col_scale = quantize_rows(padded.t())
    assert torch.equal(bits(cols), bits(want_cols)) and torch.equal(col_scale, want_col_scale.reshape(1, -1))


def test_an_unknown_recipe_is_refused_where_the_drafter_runs_not_run_as_another() -> None:
    with pytest.raises(ValueError, match="rowise"):
        losses_and_grads(drafter(), "rowise")


def test_misaligned_names_the_first_linear_whose_sizes_are_not_multiples_of_16() -> None:
    assert misaligned({"fc": (64, 192), "lm_head": (128, 64)}) is None
    assert misaligned({"fc": (64, 192), "lm_head": (100, 64)}) == "lm_head is 100x64"


# --- the drafter ----------------------------------------------------------------------------------------------


def losses_and_grads(
    model: Drafter, fp8: str, step_fn: Callable[..., Any] | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """test_cast_weights's unroll (bf16 autocast, weights cast once) with the Linears' GEMMs per ``fp8``."""
    losses, grads, _ = cast_unroll(model, torch.bfloat16, step_fn, fp8=fp8)
    return losses, grads


def linear_weights(model: Drafter) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


@pytest.mark.parametrize("fp8", [DRAFTER_FP8_ROWWISE, DRAFTER_FP8_ROWWISE_GW_HP])
def test_an_fp8_unroll_stays_near_the_bf16_one_and_every_linear_gets_its_gradient(fp8: str) -> None:
    model = drafter()
    ref, grads_ref = losses_and_grads(model, "off")
    got, grads = losses_and_grads(model, fp8)
    assert set(grads) == set(grads_ref)
    torch.testing.assert_close(got, ref, rtol=0.02, atol=0.02)
    assert not torch.equal(got, ref)  # the FP8 GEMMs ran
    for name in linear_weights(model):
        a, b = grads[f"{name}.weight"], grads_ref[f"{name}.weight"]
        assert a.dtype == torch.float32  # the parameters and their gradients keep their dtype
        cos = torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
        assert cos > 0.99, (name, cos)


def test_the_weights_are_quantised_once_an_unroll_not_once_a_ttt_step(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[list[str], list[str]]] = []

    def counting(weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        calls.append((list(weights), list(inputs or {})))
        tensors = [*weights.values(), *(inputs or {}).values()]
        assert not any(w.requires_grad for w in tensors)  # detached: no graph through the quantisation
        return weight_layouts(weights, inputs)

    monkeypatch.setattr(draft_model, "weight_layouts", counting)
    losses_and_grads(drafter(), DRAFTER_FP8_ROWWISE)
    # one call for fc, the two q/k/v halves, o, gate, up, down and lm_head, and fc's input, for the whole TTT unroll
    assert calls == [(list(FP8_WEIGHTS), [FC_INPUT])] and len(FP8_WEIGHTS) == 8


def test_fc_takes_its_input_quantised_with_the_weights_and_the_steps_get_no_fc(monkeypatch: pytest.MonkeyPatch) -> None:
    fixed: list[bool] = []
    real = draft_model.project

    def recording(x: torch.Tensor, weight: Any, bias: Any = None) -> torch.Tensor:
        if isinstance(weight, Fp8Weight):
            fixed.append(weight.fixed_input is not None)
        return real(x, weight, bias)

    monkeypatch.setattr(draft_model, "project", recording)
    step_weights: list[list[str]] = []

    def step(*args: Any) -> Any:
        step_weights.append(list(next(a for a in args if isinstance(a, dict))))  # the step's weights
        return ttt_step(*args)

    losses_and_grads(drafter(), DRAFTER_FP8_ROWWISE, step)
    assert fixed[0] and not any(fixed[1:])  # fc's first, on its quantised input; the steps' Linears quantise theirs
    assert step_weights and all(FC not in names for names in step_weights)


def bits(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as its bytes (torch.equal has no float8 kernel on the CPU), any other as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_every_weight_gets_its_two_layouts_as_quantize_rows_makes_them_one_by_one() -> None:
    model = drafter()
    casts = {n: w.detach().to(torch.bfloat16) for n, w in model.named_parameters() if n.endswith("proj.weight")}
    together = weight_layouts(casts)
    assert list(together) == list(casts)
    for name, w in casts.items():
        rows, row_scale = quantize_rows(w)  # the forward's operand, scaled per output row
        cols, col_scale = quantize_rows(w.t())  # grad_input's: W^T, scaled per input column
        want = (rows, row_scale.reshape(1, -1), cols, col_scale.reshape(1, -1))
        out_f, in_f = w.shape
        assert [tuple(t.shape) for t in together[name]] == [(out_f, in_f), (1, out_f), (in_f, out_f), (1, in_f)]
        for got, ref in zip(together[name], want, strict=True):
            assert torch.equal(bits(got), bits(ref)), name


def engine_layouts(backend: str) -> GuardedFunction:
    """fp8_layouts as the engine builds it on CUDA (compiled, under the guard), with ``backend``."""
    return GuardedFunction(weight_layouts, compiled=True, name="fp8_weights", backend=backend)


def test_the_engine_runs_the_quantisation_through_its_guarded_function_and_fresh_weights_compile_nothing() -> None:
    apply_dynamo_config()
    model = drafter()
    eager, grads_eager = cast_unroll(model, torch.bfloat16, None, fp8=DRAFTER_FP8_ROWWISE)[:2]
    layouts = engine_layouts("aot_eager")
    with compile_guard():
        got, grads = cast_unroll(model, torch.bfloat16, None, fp8=DRAFTER_FP8_ROWWISE, fp8_layouts=layouts)[:2]
    layouts.mark_warm()
    graphs = layouts.graph_count()
    assert graphs == 1  # every weight in one graph
    torch.testing.assert_close(got, eager, rtol=0, atol=0)
    for name, g in grads_eager.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # new weights: graph inputs, not constants
    with compile_guard():
        cast_unroll(model, torch.bfloat16, None, fp8=DRAFTER_FP8_ROWWISE, fp8_layouts=layouts)
    assert layouts.graph_count() == graphs and not layouts.events  # no recompile


@pytest.mark.slow
def test_the_quantisation_compiled_by_inductor_gives_the_eager_layouts_bit_for_bit() -> None:
    """What CUDA runs (inductor), on the CPU here: power-of-two scales and the same e4m3 values."""
    apply_dynamo_config()
    model = drafter()
    casts = {n: w.detach().to(torch.bfloat16) for n, w in model.named_parameters() if n.endswith("weight")}
    casts = {n: w for n, w in casts.items() if w.dim() == 2}
    eager = weight_layouts(casts)
    with compile_guard():
        compiled = engine_layouts("inductor")(casts)
    for name, want in eager.items():
        for got, ref in zip(compiled[name], want, strict=True):
            assert got.dtype == ref.dtype and got.shape == ref.shape
            assert torch.equal(bits(got), bits(ref)), name


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_fp8_step_gives_eager_numerics_and_takes_fresh_weights_without_recompiling() -> None:
    apply_dynamo_config()
    model = drafter()
    eager, grads_eager = losses_and_grads(model, DRAFTER_FP8_ROWWISE)
    step_fn = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="aot_eager")
    with compile_guard():
        compiled, grads_compiled = losses_and_grads(model, DRAFTER_FP8_ROWWISE, step_fn)
    step_fn.mark_warm()
    graphs = step_fn.graph_count()
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for name, g in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], g, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)  # new weights, new e4m3 copies: graph inputs, not constants
    with compile_guard():
        losses_and_grads(model, DRAFTER_FP8_ROWWISE, step_fn)
    assert step_fn.graph_count() == graphs


@pytest.mark.slow
def test_fp8_linears_compile_whole_under_inductor_and_agree_with_eager_to_e4m3_rounding_flips() -> None:
    """What CUDA runs (inductor, one graph, no break at the autograd Function); on the CPU here. Inductor keeps
    silu's result in float32 where eager rounds it to bf16 first, so a few e4m3 roundings flip: measured 1.2 % on
    the gradients through that silu, 0 on the last weight's."""

    def two_linears(x: torch.Tensor, w: list[Fp8Weight]) -> torch.Tensor:
        return (fp8_linear(torch.nn.functional.silu(fp8_linear(x, w[0])), w[1]).float() ** 2).sum()

    torch.manual_seed(0)
    x = torch.randn(2, 40, 64).to(torch.bfloat16).requires_grad_()
    params = [(torch.randn(128, 64) * 0.1).requires_grad_(), (torch.randn(64, 128) * 0.1).requires_grad_()]

    def run(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        x.grad = params[0].grad = params[1].grad = None
        out = fn(x, [fp8_weight(p.to(torch.bfloat16), grad_weight_fp8=True) for p in params])
        out.backward()
        return [t.detach().clone() for t in (out, x.grad, params[0].grad, params[1].grad) if t is not None]

    eager = run(two_linears)
    compiled = run(torch.compile(two_linears, backend="inductor", fullgraph=True))
    assert len(compiled) == 4
    errors = [relative_error(c, e) for c, e in zip(compiled, eager, strict=True)]
    assert errors[0] < 1e-5 and errors[3] < 1e-5, errors
    assert max(errors[1:3]) < 0.03, errors
