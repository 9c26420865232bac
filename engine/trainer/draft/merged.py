"""The TTT attention as one fused causal kernel over block 0, with the diagonals merged by log-sum-exp.

At TTT step ``i`` a query sees block 0 causally and, in each of the ``i`` later blocks, one key: its own
position (masks.py). flex_attention computes every diagonal as a whole 128 x 128 tile with one useful entry a
row. Here block 0 runs in a fused causal attention kernel that returns its log-sum-exp ``lse0`` (cuDNN's or
FlashAttention-2's on CUDA, ATen's flash kernel on the CPU), the ``i`` diagonal scores are one dot product a
position, and the two are merged:

    lse = log(exp(lse0) + sum_j exp(s_j)),    out = exp(lse0 - lse) * out0 + sum_j exp(s_j - lse) * v_j

Backward, exactly: block 0's gradients are the fused kernel's own backward called with the merged ``out`` and
the merged ``lse``: it forms ``P = exp(S - lse)`` (the full softmax's probabilities over block 0) and
``D = rowsum(dout * out)``, which is the full softmax's gradient restricted to block 0, so no gradient through
``lse0`` is needed. The diagonals' are ``dS_j = P_j * (dout . v_j - D)``, elementwise.

Grouped-query heads: the kernels get block 0's keys and values repeated to the query heads, and their gradients
are summed back over each group.

On CUDA it is refused (run/assembly.py): inside the whole drafter on an H200 (8B shape, batch 2, TTT 7, bf16) the
gradients of everything before the attention came out 120-190 % off a float32 reference, eager or compiled, while
the kernel alone on random inputs agrees to 3e-3 (tests/bench/bench_kernels.py, parts ``unroll`` and ``attention``).
The inputs differ in layout: in the drafter q and k come from the rotary of a transposed projection, and at later
TTT steps ``out`` is made here contiguous while cuDNN returns it in q's layout. The likely cause, read in PyTorch's
source and not yet verified on a GPU: cuDNN's backward caches its graph under q, k and v's shapes and strides only
(not out's and dout's), so step 0's backward, which runs last, reuses the graph built for the later steps' layout.
In the whole engine merged was no faster than flex anyway (438.5 against 438.8 ms a step, one call, an H200).
The CPU path (ATen's flash kernel) is exact (float64 tests).
"""

from __future__ import annotations

from typing import Any

import torch

BACKENDS: tuple[str, ...] = ("cudnn", "flash", "cpu")


def device_backend(device: torch.device) -> str | None:
    """cuDNN's fused attention on Hopper and later, FlashAttention-2 on Ampere, ATen's flash kernel on the CPU;
    None for a GPU older than sm80 (no fused kernel with a log-sum-exp there)."""
    if device.type == "cpu":
        return "cpu"
    major = torch.cuda.get_device_capability(device)[0]
    return "cudnn" if major >= 9 else "flash" if major >= 8 else None


def default_backend(device: torch.device) -> str:
    backend = device_backend(device)
    if backend is None:
        raise ValueError(f"merged attention needs an sm80 or later GPU; {device} is older: use flex")
    return backend


def _repeat_heads(x: torch.Tensor, group: int) -> torch.Tensor:  # (B, Hkv, T, D) -> (B, Hkv * group, T, D)
    if group == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, group, t, d).reshape(b, h * group, t, d)


def _sum_groups(dx: torch.Tensor, group: int) -> torch.Tensor:  # (B, Hq, T, D) -> (B, Hq / group, T, D)
    if group == 1:
        return dx
    b, h, t, d = dx.shape
    return dx.view(b, h // group, group, t, d).sum(2)


def _in_layout_of(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``x`` with ``ref``'s memory layout: (B, H, T, D) contiguous, or (B, T, H, D) seen transposed."""
    if x.stride() == ref.stride():
        return x
    if ref.is_contiguous():
        return x.contiguous()
    if ref.transpose(1, 2).is_contiguous():
        return x.transpose(1, 2).contiguous().transpose(1, 2)
    return torch.empty_strided(ref.shape, ref.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _causal_forward(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]:  # out, lse, what the backward needs
    if backend == "cudnn":
        r = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
        return r[0], r[1], (r[6], r[7])
    if backend == "flash":
        r = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return r[0], r[1], (r[6], r[7])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
    return out, lse, ()


def _causal_backward(
    backend: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    state: tuple[Any, ...],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = q.shape[2]
    if backend == "cudnn":
        dout = _in_layout_of(dout, out)  # cuDNN reads dout in out's layout
        seed, offset = state
        r = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse, seed, offset, None, None, None, t, t, 0.0, True, scale=scale
        )
    elif backend == "flash":
        seed, offset = state
        r = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, t, t, 0.0, True, seed, offset, scale=scale
        )
    else:
        r = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, True, scale=scale
        )
    return r[0], r[1], r[2]


class _MergedTTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, backend: str) -> torch.Tensor:
        b, hq, t, d = q.shape
        hkv = k_all.shape[1]
        group, blocks = hq // hkv, k_all.shape[2] // t
        scale, acc = d**-0.5, torch.promote_types(q.dtype, torch.float32)  # merged in float32 at least
        k0 = _repeat_heads(k_all[:, :, :t], group)
        v0 = _repeat_heads(v_all[:, :, :t], group)
        out0, lse0, state = _causal_forward(backend, q, k0, v0, scale)
        if blocks == 1:
            out, lse = out0, lse0
        else:
            qg = q.view(b, hkv, group, 1, t, d).to(acc)
            kd = k_all[:, :, t:].view(b, hkv, 1, blocks - 1, t, d).to(acc)
            vd = v_all[:, :, t:].view(b, hkv, 1, blocks - 1, t, d).to(acc)
            s = (qg * kd).sum(-1) * scale  # (B, Hkv, G, i, T): the diagonal scores
            l0 = lse0.reshape(b, hkv, group, 1, t)
            merged = torch.logsumexp(torch.cat((l0, s), dim=3), dim=3, keepdim=True)  # (B, Hkv, G, 1, T)
            p = torch.exp(s - merged)
            o = torch.exp(l0 - merged).squeeze(3)[..., None] * out0.view(b, hkv, group, t, d).to(acc)
            o = o + (p[..., None] * vd).sum(3)
            # Made functionally: an empty_like + copy_ here gave zero gradients at steps >= 1 compiled on CUDA (H200,
            # torch 2.11; right on the CPU). Contiguous: the kernels' backwards take out in any layout dout matches.
            out = o.view(b, hq, t, d).to(q.dtype)
            lse = merged.reshape(lse0.shape)
        ctx.save_for_backward(q, k_all, v_all, out, lse, *state)
        ctx.backend = backend
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k_all, v_all, out, lse, *state = ctx.saved_tensors
        b, hq, t, d = q.shape
        hkv = k_all.shape[1]
        group, blocks = hq // hkv, k_all.shape[2] // t
        scale, acc = d**-0.5, torch.promote_types(q.dtype, torch.float32)
        k0 = _repeat_heads(k_all[:, :, :t], group)
        v0 = _repeat_heads(v_all[:, :, :t], group)
        dq, dk0, dv0 = _causal_backward(ctx.backend, dout, q, k0, v0, out, lse, tuple(state), scale)
        dk0, dv0 = _sum_groups(dk0, group), _sum_groups(dv0, group)
        if blocks == 1:
            return dq, dk0, dv0, None
        qg = q.view(b, hkv, group, 1, t, d).to(acc)
        kd = k_all[:, :, t:].view(b, hkv, 1, blocks - 1, t, d).to(acc)
        vd = v_all[:, :, t:].view(b, hkv, 1, blocks - 1, t, d).to(acc)
        do = dout.reshape(b, hkv, group, 1, t, d).to(acc)
        rows = (do * out.reshape(b, hkv, group, 1, t, d).to(acc)).sum(-1)  # D: (B, Hkv, G, 1, T)
        s = (qg * kd).sum(-1) * scale
        p = torch.exp(s - lse.reshape(b, hkv, group, 1, t))  # the diagonals' probabilities
        ds = p * ((do * vd).sum(-1) - rows)  # (B, Hkv, G, i, T)
        dq = (dq.to(acc) + ((ds[..., None] * kd).sum(3) * scale).view(b, hq, t, d)).to(dq.dtype)
        dkd = (ds[..., None] * qg).sum(2) * scale  # (B, Hkv, i, T, D)
        dvd = (p[..., None] * do).sum(2)
        dk = torch.cat((dk0[:, :, None], dkd.to(dk0.dtype)), dim=2).view(b, hkv, blocks * t, d)
        dv = torch.cat((dv0[:, :, None], dvd.to(dv0.dtype)), dim=2).view(b, hkv, blocks * t, d)
        return dq, dk, dv, None


def kernel_for(backend: str, head_dim: int) -> str:
    """The backend that takes this head size: cuDNN's up to 128 wide, FlashAttention-2's up to 256, multiples of 8."""
    if backend not in BACKENDS:
        raise ValueError(f"merged attention backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend == "cpu":
        return backend
    if head_dim % 8 or head_dim > 256:
        raise ValueError(f"merged attention: no fused CUDA kernel for {head_dim}-wide heads; use attention = 'flex'")
    return "flash" if backend == "cudnn" and head_dim > 128 else backend


def merged_ttt_attention(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, backend: str) -> torch.Tensor:
    """Step ``i``'s TTT attention: q ``(B, Hq, T, D)``, k/v ``(B, Hkv, (i + 1) T, D)`` -> ``(B, Hq, T, D)``."""
    backend = kernel_for(backend, q.shape[-1])
    return _MergedTTTAttention.apply(q, k_all, v_all, backend)
