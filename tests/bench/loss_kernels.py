"""Loss-kernel candidates for tests/bench/bench_kernels.py's ``loss`` part (not used by the engine).

The drafter's loss needs five reductions over each row of its logits ``z`` and the target's distribution ``p``
shifted to the TTT step's targets: ``lse(z)``, ``sum p``, ``sum p*z``, ``argmax z`` and ``argmax p``
(engine/trainer/draft/loss.py makes the loss ``lse * sum p - sum p*z`` from them). Compiled from the expression,
Inductor reads z and p in several loops over a shifted copy of p: 1.3 ms a TTT step inside the engine's step at
batch 4 x 2048 x 32000 on an H200 (0.9 ms alone), against about 0.3 ms to read 1.5 GB once.

Two Triton kernels, each one pass over the row, p read unshifted (position t reads row t + shift, zeros past the
end), with an online log-sum-exp:

* ``block``: each block of the row reduced to scalars before the next (five cross-warp reductions a block).
  Session 7 measured it at 0.857 ms forward against the expression's 0.903: no gain.
* ``lanes``: every lane keeps its own running maximum, sum, argmaxes and sums across the whole row, and the lanes
  are reduced once at the end, so the loop has no cross-warp reduction in it (not yet measured).

Each runs inside a custom op whose gradient (to z only) is the PyTorch expression ``g_lse * softmax(z) + g_pz * p``,
which the compiled backward fuses in one pass. ``TRITON_INTERPRET=1`` runs them on the CPU (slow; for a check).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.trainer.draft.model import shift_left  # row t + n at t, zeros past the end: the TTT step's shift

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds of torch: the bench's dry run skips these candidates
    triton = None

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def reference_rows(z: torch.Tensor, p: torch.Tensor, shift: int) -> Rows:
    """The five row values from the PyTorch expression (the engine's loss computes these)."""
    zf = z.float()
    pf = shift_left(p, shift).float()
    return torch.logsumexp(zf, dim=-1), pf.sum(-1), (pf * zf).sum(-1), z.argmax(-1), pf.argmax(-1)


if triton is not None:
    _FLOOR = tl.constexpr(-3.0e38)  # below any logit, not -inf: exp(m_old - m_new) is 0, never inf - inf

    @triton.jit
    def _rows_block(  # type: ignore[no-untyped-def]
        z_ptr, p_ptr, lse_ptr, ps_ptr, pz_ptr, za_ptr, pa_ptr, seq_len, vocab, shift, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        p_end = tl.where((row % seq_len) + shift < seq_len, vocab, 0)
        z_row = z_ptr + row.to(tl.int64) * vocab
        p_row = p_ptr + (row + shift).to(tl.int64) * vocab
        m = tl.full((), _FLOOR, tl.float32)
        s = tl.zeros((), tl.float32)
        ps = tl.zeros((), tl.float32)
        pz = tl.zeros((), tl.float32)
        za = tl.zeros((), tl.int32)
        pb = tl.full((), -1.0, tl.float32)
        pa = tl.zeros((), tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            inside = offs < vocab
            z = tl.load(z_row + offs, mask=inside, other=_FLOOR).to(tl.float32)
            p = tl.load(p_row + offs, mask=offs < p_end, other=0.0).to(tl.float32)
            bm, bi = tl.max(z, 0, return_indices=True, return_indices_tie_break_left=True)
            new_m = tl.maximum(m, bm)
            s = s * tl.exp(m - new_m) + tl.sum(tl.where(inside, tl.exp(z - new_m), 0.0), 0)
            za = tl.where(bm > m, start + bi, za)
            m = new_m
            ps += tl.sum(p, 0)
            pz += tl.sum(p * tl.where(inside, z, 0.0), 0)
            pm, pi = tl.max(tl.where(inside, p, -1.0), 0, return_indices=True, return_indices_tie_break_left=True)
            pa = tl.where(pm > pb, start + pi, pa)
            pb = tl.maximum(pb, pm)
        tl.store(lse_ptr + row, m + tl.log(s))
        tl.store(ps_ptr + row, ps)
        tl.store(pz_ptr + row, pz)
        tl.store(za_ptr + row, za.to(tl.int64))
        tl.store(pa_ptr + row, pa.to(tl.int64))

    @triton.jit
    def _rows_lanes(  # type: ignore[no-untyped-def]
        z_ptr, p_ptr, lse_ptr, ps_ptr, pz_ptr, za_ptr, pa_ptr, seq_len, vocab, shift, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        p_end = tl.where((row % seq_len) + shift < seq_len, vocab, 0)
        z_row = z_ptr + row.to(tl.int64) * vocab
        p_row = p_ptr + (row + shift).to(tl.int64) * vocab
        lanes = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), _FLOOR, tl.float32)  # each lane's running maximum of z
        s = tl.zeros((BLOCK,), tl.float32)  # each lane's sum of exp(z - m)
        za = tl.zeros((BLOCK,), tl.int32)  # each lane's first index of its maximum
        ps = tl.zeros((BLOCK,), tl.float32)
        pz = tl.zeros((BLOCK,), tl.float32)
        pb = tl.full((BLOCK,), -1.0, tl.float32)
        pa = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, vocab, BLOCK):
            offs = start + lanes
            inside = offs < vocab
            z = tl.load(z_row + offs, mask=inside, other=_FLOOR).to(tl.float32)
            p = tl.load(p_row + offs, mask=offs < p_end, other=0.0).to(tl.float32)
            new_m = tl.maximum(m, z)
            s = s * tl.exp(m - new_m) + tl.where(inside, tl.exp(z - new_m), 0.0)
            za = tl.where(z > m, offs, za)
            m = new_m
            ps += p
            pz += p * tl.where(inside, z, 0.0)
            better = tl.where(inside, p, -1.0) > pb
            pa = tl.where(better, offs, pa)
            pb = tl.where(better, p, pb)
        top = tl.max(m, 0)
        tl.store(lse_ptr + row, top + tl.log(tl.sum(s * tl.exp(m - top), 0)))
        tl.store(ps_ptr + row, tl.sum(ps, 0))
        tl.store(pz_ptr + row, tl.sum(pz, 0))
        tl.store(za_ptr + row, tl.min(tl.where(m == top, za, vocab), 0).to(tl.int64))  # the first maximum wins
        p_top = tl.max(pb, 0)
        tl.store(pa_ptr + row, tl.min(tl.where(pb == p_top, pa, vocab), 0).to(tl.int64))

    KERNELS: dict[str, Any] = {"block": _rows_block, "lanes": _rows_lanes}
else:
    KERNELS = {}


def kernel_rows(kind: str, z: torch.Tensor, p: torch.Tensor, shift: int, block: int, warps: int) -> Rows:
    """The five row values from candidate ``kind`` (z and p ``(B, T, V)``, made contiguous)."""
    b, t, v = z.shape
    z, p = z.contiguous(), p.contiguous()
    lse, ps, pz = (torch.empty((b, t), dtype=torch.float32, device=z.device) for _ in range(3))
    za, pa = (torch.empty((b, t), dtype=torch.int64, device=z.device) for _ in range(2))
    KERNELS[kind][(b * t,)](z, p, lse, ps, pz, za, pa, t, v, shift, BLOCK=block, num_warps=warps)
    return lse, ps, pz, za, pa


@torch.library.custom_op("specdec_bench::loss_rows", mutates_args=())
def _loss_rows_op(z: torch.Tensor, p: torch.Tensor, shift: int, kind: str, block: int, warps: int) -> Rows:
    return kernel_rows(kind, z, p, shift, block, warps)


@_loss_rows_op.register_fake
def _(z: torch.Tensor, p: torch.Tensor, shift: int, kind: str, block: int, warps: int) -> Rows:
    rows = z.shape[:-1]
    f32, i64 = torch.float32, torch.int64
    return (z.new_empty(rows, dtype=f32), z.new_empty(rows, dtype=f32), z.new_empty(rows, dtype=f32),
            z.new_empty(rows, dtype=i64), z.new_empty(rows, dtype=i64))  # fmt: skip


def _setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    ctx.save_for_backward(inputs[0], inputs[1], output[0])
    ctx.shift = inputs[2]


def _backward(ctx: Any, g_lse: Any, _g_ps: Any, g_pz: Any, _g_za: Any, _g_pa: Any) -> tuple[Any, ...]:
    z, p, lse = ctx.saved_tensors
    dz = torch.exp(z.float() - lse.unsqueeze(-1)) * g_lse.unsqueeze(-1)
    dz = dz + shift_left(p, ctx.shift).float() * g_pz.unsqueeze(-1)
    return dz.to(z.dtype), None, None, None, None, None


_loss_rows_op.register_autograd(_backward, setup_context=_setup)


def candidate_rows(kind: str, block: int, warps: int) -> Any:
    """A rows function ``(z, p, shift) -> Rows`` running candidate ``kind`` inside the custom op (compile-safe)."""

    def rows(z: torch.Tensor, p: torch.Tensor, shift: int) -> Rows:
        out: Rows = _loss_rows_op(z, p, shift, kind, block, warps)
        return out

    return rows
