"""The drafter's Linear GEMMs in FP8 (``drafter_fp8``): forward, grad_input and grad_weight as ``torch._scaled_mm``.

Each GEMM quantises both operands to e4m3 with one scale per row along that GEMM's reduction dimension (torchao's
float8 "rowwise" recipe), accumulates in fp32 and writes bf16:

- forward ``y = x @ W^T``: x per token, W per output row (both along the input features);
- grad_input ``dx = dy @ W``: dy per token, W per input column (both along the output features);
- grad_weight ``dW = dy^T @ x``: dy per output feature, x per input feature (both along the tokens).

``rowwise_gw_hp`` keeps grad_weight a bf16 GEMM (torchao's ``rowwise_with_gw_hp``): the weight gradient sums over
every token of the batch, where e4m3's rounding of the gradient adds up most.

Gradients are e4m3 too, not e5m2: a scale per row brings each row's largest value to e4m3's 448, so e5m2's wider
range buys nothing and e4m3's extra mantissa bit halves the rounding error (torchao's rowwise recipes do the same).
Scales are powers of two (the smallest at or above ``amax / 448``, as torchao's rowwise rounds them), so scaling
is exact and only the e4m3 rounding of the values remains.

The weights are quantised once a training step (``weight_layouts``: both layouts of every weight in one call,
compiled by the engine on CUDA when ``compile`` is on), not in every TTT step: the parameters stay as they are (fp32
masters, or what the run keeps), their gradients reach them through the cast weight an ``Fp8Weight`` carries, and
exports are unchanged. fc's input (the target's states, which take no gradient) is quantised in the same call, in
both layouts (``input_layouts``), and fc's weight carries them (``Fp8Weight.fixed_input``): fc runs outside the
compiled step, where quantising it per use took about 4 ms a step in eager passes (at the 8B shape, batch 4, the
whole step took 302.9 ms before on one H100 and 298.8 ms after on another).

Every matrix size must be a multiple of 16 (``_scaled_mm``); a token count that is not is padded with zero tokens
for grad_weight (they add nothing).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
AMAX_FLOOR = 1e-12  # an all-zero row keeps a finite scale
MATMUL_ALIGN = 16  # _scaled_mm's operands: every size a multiple of this


Layouts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # rows, row_scale, cols, col_scale


class Fp8Weight(NamedTuple):
    """A Linear's weight for one training step: the cast weight and its two e4m3 layouts with their scales."""

    weight: torch.Tensor  # (out, in), the cast weight: the weight gradient lands here (and flows to the parameter)
    rows: torch.Tensor  # (out, in) e4m3, scaled per output row: the forward's operand
    row_scale: torch.Tensor  # (1, out) float32
    cols: torch.Tensor  # (in, out) e4m3, W^T scaled per input column: grad_input's operand
    col_scale: torch.Tensor  # (1, in) float32
    grad_weight_fp8: bool  # grad_weight in FP8 ("rowwise") or as a bf16 GEMM ("rowwise_gw_hp")
    # fc's: its input (the target's states, which take no gradient) in both layouts, quantised with the weights
    # (``input_layouts``); None: the input is quantised where it is used (the steps' Linears, fused in their graph)
    fixed_input: Layouts | None = None
    # gate's and up's under drafter_fp8_mlp = "fused": the layer runs the pair as one node (draft/fp8_mlp.py)
    fused_mlp: bool = False


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """The scales for float32 maxima: the smallest power of two at or above ``max(amax, AMAX_FLOOR) / 448``."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(AMAX_FLOOR) / E4M3_MAX)))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, row-major, the float32 scale per row as a column): ``x ~= q * scale``, scale a power of two."""
    # Few passes over x where it runs eager (the weights, fc): the max without an |x| copy, one float32 temporary.
    scale = pow2_scales(torch.linalg.vector_norm(x, ord=math.inf, dim=-1, keepdim=True).float())
    # The clamp: log2's rounding could put a scale a power of two low, and e4m3fn turns what exceeds 448 into NaN.
    q = (x / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
    return q, scale


def _scaled_mm(a: torch.Tensor, b_t: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """``(a * scale_a) @ (b_t * scale_b^T)^T`` in bf16: a (M, K), b_t (N, K) e4m3 row-major, scales (M, 1), (1, N)."""
    return torch._scaled_mm(a, b_t.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)


def _pad_tokens(x_t: torch.Tensor) -> torch.Tensor:
    """(features, tokens) with zero tokens appended up to a multiple of MATMUL_ALIGN (a static shape: no branch)."""
    extra = -x_t.shape[-1] % MATMUL_ALIGN
    return F.pad(x_t, (0, extra)) if extra else x_t


def input_layouts(x: torch.Tensor) -> Layouts:
    """A fixed input (tokens, in) in both e4m3 layouts: rows (tokens', in) per token with scales (tokens', 1), the
    forward's operand; cols (in, tokens') per input feature along the tokens with scales (1, in), grad_weight's.
    tokens' is the token count padded with zero tokens to a multiple of MATMUL_ALIGN (the forward drops their rows)."""
    extra = -x.shape[0] % MATMUL_ALIGN
    x = F.pad(x, (0, 0, 0, extra)) if extra else x
    rows, row_scale = quantize_rows(x)
    cols, col_scale = quantize_rows(x.t())
    return rows, row_scale, cols, col_scale.reshape(1, -1)


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,  # (M, in)
        weight: torch.Tensor,  # (out, in): only its gradient is made here
        rows: torch.Tensor,
        row_scale: torch.Tensor,
        cols: torch.Tensor,
        col_scale: torch.Tensor,
        grad_weight_fp8: bool,
    ) -> torch.Tensor:  # (M, out) bf16
        xq, x_scale = quantize_rows(x)
        ctx.save_for_backward(x, cols, col_scale)
        ctx.grad_weight_fp8 = grad_weight_fp8
        ctx.weight_dtype = weight.dtype
        return _scaled_mm(xq, rows, x_scale, row_scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, cols, col_scale = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:  # fc's input (the target's states) needs none: no GEMM, no quantising pass
            gq, g_scale = quantize_rows(grad)  # per token, along the output features
            grad_x = _scaled_mm(gq, cols, g_scale, col_scale).to(x.dtype)
        if ctx.grad_weight_fp8:
            gtq, gt_scale = quantize_rows(_pad_tokens(grad.t()))  # per output feature, along the tokens
            xtq, xt_scale = quantize_rows(_pad_tokens(x.t()))  # per input feature, along the tokens
            grad_w = _scaled_mm(gtq, xtq, gt_scale, xt_scale.reshape(1, -1))
        else:
            grad_w = grad.t().to(torch.bfloat16) @ x.to(torch.bfloat16)
        return grad_x, grad_w.to(ctx.weight_dtype), None, None, None, None, None


class _Fp8MatmulFixedInput(torch.autograd.Function):
    """``_Fp8Matmul`` for an input that takes no gradient and comes quantised (``input_layouts``): no pass over the
    input here, forward or backward; only grad_weight's quantisation of the incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        weight: torch.Tensor,  # (out, in): only its gradient is made here
        rows: torch.Tensor,
        row_scale: torch.Tensor,
        x: torch.Tensor,  # (M, in) as given: grad_weight's operand when that GEMM is bf16
        x_rows: torch.Tensor,  # (M', in) e4m3, M' = M padded to a multiple of MATMUL_ALIGN
        x_row_scale: torch.Tensor,  # (M', 1)
        x_cols: torch.Tensor,  # (in, M') e4m3
        x_col_scale: torch.Tensor,  # (1, in)
        grad_weight_fp8: bool,
    ) -> torch.Tensor:  # (M, out) bf16
        if grad_weight_fp8:
            ctx.save_for_backward(x_cols, x_col_scale)
        else:
            ctx.save_for_backward(x)
        ctx.grad_weight_fp8 = grad_weight_fp8
        ctx.weight_dtype = weight.dtype
        return _scaled_mm(x_rows, rows, x_row_scale, row_scale)[: x.shape[0]]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.grad_weight_fp8:
            x_cols, x_col_scale = ctx.saved_tensors
            gtq, gt_scale = quantize_rows(_pad_tokens(grad.t()))  # per output feature, along the tokens
            grad_w = _scaled_mm(gtq, x_cols, gt_scale, x_col_scale)
        else:
            (x,) = ctx.saved_tensors
            grad_w = grad.t().to(torch.bfloat16) @ x.to(torch.bfloat16)
        return (grad_w.to(ctx.weight_dtype), *([None] * 8))


def weight_layouts(
    weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor] | None = None
) -> dict[str, Layouts]:
    """Both e4m3 layouts of each weight (detached) with their scales, as ``Fp8Weight`` holds them, and of each fixed
    input (``input_layouts``; fc's, flattened to (tokens, in)), under the same names. One call for all of a
    drafter's weights and fc's input: compiled (run/assembly.py ``fp8_layouts``), a few fused kernels instead of a
    dozen eager passes per weight (and four over fc's input, the largest activation)."""
    out: dict[str, Layouts] = {}
    for name, w in weights.items():
        rows, row_scale = quantize_rows(w)
        cols, col_scale = quantize_rows(w.t())
        out[name] = (rows, row_scale.reshape(1, -1), cols, col_scale.reshape(1, -1))
    for name, x in (inputs or {}).items():
        out[name] = input_layouts(x)
    return out


def fp8_weight(weight: torch.Tensor, *, grad_weight_fp8: bool) -> Fp8Weight:
    """``weight`` (a cast of the parameter, differentiable) with its e4m3 layouts, quantised once for a step."""
    with torch.no_grad():
        layouts = weight_layouts({"w": weight.detach()})["w"]
    return Fp8Weight(weight, *layouts, grad_weight_fp8)


def fp8_linear(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """``x @ W^T`` (x (..., in)) with its three GEMMs in FP8 (grad_weight in bf16 where the weight says): bf16 out.
    A weight with a ``fixed_input`` takes that input's layouts, made from this ``x`` (which takes no gradient)."""
    flat = x.reshape(-1, x.shape[-1])
    if w.fixed_input is not None:
        out = _Fp8MatmulFixedInput.apply(w.weight, w.rows, w.row_scale, flat, *w.fixed_input, w.grad_weight_fp8)
    else:
        out = _Fp8Matmul.apply(flat, w.weight, w.rows, w.row_scale, w.cols, w.col_scale, w.grad_weight_fp8)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def project(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)``: in FP8 for an ``Fp8Weight``, else ``F.linear``."""
    if isinstance(weight, Fp8Weight):
        out = fp8_linear(x, weight)
        return out if bias is None else out + bias.to(out.dtype)
    return F.linear(x, weight, bias)


def misaligned(shapes: dict[str, tuple[int, int]]) -> str | None:
    """The first Linear whose (out, in) sizes are not both multiples of 16, as words; None when all are."""
    for name, (out_f, in_f) in shapes.items():
        if out_f % MATMUL_ALIGN or in_f % MATMUL_ALIGN:
            return f"{name} is {out_f}x{in_f}"
    return None


@functools.cache
def cpu_rowwise_supported() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales (2.13 does; older builds only per-tensor)."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        _scaled_mm(a, a, torch.ones(16, 1), torch.ones(1, 16))
    except (RuntimeError, NotImplementedError):
        return False
    return True
