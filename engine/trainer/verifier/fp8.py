"""FP8 forward for the frozen target (``target_fp8 = true``): the decoder's Linear layers as e4m3 matmuls.

The target never trains, so its weights are quantised once, per output row (``scale_w = amax(row) / 448``),
and each forward quantises its activations per token (``scale_x = amax(token) / 448``); the matmul is
``torch._scaled_mm`` with both row-wise scales, accumulating in fp32 and writing bf16. On Hopper this runs
the target's matmuls at FP8 rate; under ``compile_target`` the activation scaling fuses into the producers
of each matmul.

What stays in the model's dtype: the embeddings, the norms, attention itself, ``lm_head``, whose logits
define the drafter's training targets (the draft-vocabulary logits and the position mask), MoE routers
(``SKIPPED_MODULES``), and whatever lies outside the decoder's layers (a multimodal wrapper's vision tower and
projector: text never runs them; ``load_target`` quantises the decoder layers only).

The exact target stays reachable: ``quantize_linears(keep_exact=True)`` keeps each replaced Linear's original
weight tensor (the same storage, no copy), and inside ``exact_linears(model)`` every ``Fp8Linear`` runs the exact
matmul. Acceptance length is measured that way, against the target a server runs, not the FP8 one the drafter
trains on. The cost is the exact decoder weights on top of the e4m3 ones: on Llama-3.1-8B 14.0 GB of bf16 beside
7.0 GB of e4m3, the whole target 23.0 GB against 16.1 GB in bf16 and 9.1 GB in FP8 alone (and the same peak while
quantising, which otherwise frees each bf16 weight as it goes). ``release_exact`` frees them when nothing evaluates.

How far FP8 moves the target is measured by ``verifier/agreement.py`` (top-1 agreement, KL of ``target_p``,
error of the captured hidden states): at the start of an FP8 run on its first training batches' trained positions,
and offline by ``tests/bench/bench_fp8_target.py``; it must be judged per target before a run trusts it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn value
SCALE_FLOOR = 1e-12  # an all-zero row or token keeps a finite scale
MIN_CUDA_CAPABILITY = (9, 0)  # row-wise scaled FP8 matmuls (torch._scaled_mm): Hopper onwards
# Kept exact, by the Linear's own name. lm_head: its logits are the training targets. MoE routers (Mixtral's
# block_sparse_moe.gate, Qwen-MoE's mlp.gate and mlp.shared_expert_gate, Llama-4's feed_forward.router): a
# rounding that reorders their few logits sends a token to other experts. A dense MLP's gate_proj is no router.
SKIPPED_MODULES = ("lm_head", "gate", "router", "shared_expert_gate")


def fp8_unsupported_reason(device: torch.device, key: str = "target_fp8") -> str | None:
    """Why ``device`` cannot run the FP8 target (or what ``key`` asks for), or None when it can (CUDA 9.0+, or the
    CPU: the caller knows what its CPU path needs)."""
    if device.type == "cpu":
        return None  # the same e4m3 rounding through a dequantized matmul: for tests and small targets
    if device.type != "cuda":
        return f"{key} needs a CUDA or CPU device, not {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < MIN_CUDA_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"{key} needs row-wise FP8 matmuls (compute capability 9.0+, Hopper); {device} is {name} ({major}.{minor})"
        )
    return None


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x quantised to e4m3 per row, the fp32 scale per row as a column): ``x ~= q * scale``."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(SCALE_FLOOR) / E4M3_MAX
    q = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


class Fp8Linear(nn.Module):
    """A frozen Linear whose weight is stored in e4m3 with one fp32 scale per output row.

    ``keep_exact``: it also keeps the Linear's weight tensor (shared, not copied), and runs the exact matmul with
    it while ``exact`` is set (``exact_linears``)."""

    def __init__(self, linear: nn.Linear, *, keep_exact: bool = False) -> None:
        super().__init__()
        if linear.in_features % 16 or linear.out_features % 16:
            raise ValueError(
                f"an FP8 matmul needs both sizes divisible by 16, not {linear.out_features}x{linear.in_features}"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.out_dtype = linear.weight.dtype
        self.weight_fp8: torch.Tensor
        self.weight_scale: torch.Tensor
        self.bias: torch.Tensor | None
        q, scale = _rowwise(linear.weight.detach())
        self.register_buffer("weight_fp8", q)  # (out, in) row-major: its transpose is the column-major operand
        self.register_buffer("weight_scale", scale.reshape(1, -1))  # (1, out)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.exact_weight: torch.Tensor | None
        # Not persistent: a state_dict of the model holds what a checkpoint of it would (the e4m3 weights).
        self.register_buffer("exact_weight", linear.weight.detach() if keep_exact else None, persistent=False)
        self.exact = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            if self.exact_weight is None:
                raise RuntimeError("this FP8 Linear keeps no exact weight (quantized without keep_exact, or released)")
            return F.linear(x, self.exact_weight, self.bias)
        shape = x.shape
        flat = x.reshape(-1, self.in_features)
        q, scale = _rowwise(flat)
        if flat.device.type == "cpu":  # torch's CPU _scaled_mm takes only per-tensor scales (before 2.13)
            w = self.weight_fp8.float() * self.weight_scale.t()
            out = (q.float() * scale) @ w.t()
            if self.bias is not None:
                out = out + self.bias.float()
            return out.to(self.out_dtype).reshape(*shape[:-1], self.out_features)
        # Row-wise scaling writes bf16 only: a float32 target (dtype = "float32") gets bf16 products, cast back.
        fused_bias = self.out_dtype == torch.bfloat16
        out = torch._scaled_mm(
            q,
            self.weight_fp8.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias if fused_bias else None,
            out_dtype=torch.bfloat16,
        )
        if not fused_bias:
            out = out.to(self.out_dtype)
            if self.bias is not None:
                out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 row-wise"


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = SKIPPED_MODULES, *, keep_exact: bool = False) -> int:
    """Replaces every ``nn.Linear`` of ``model`` (except those named in ``skip``) by an ``Fp8Linear``, in place.

    Returns how many were replaced. The bf16 weights they held are released, unless ``keep_exact`` keeps them
    for ``exact_linears`` (the memory the model had, plus the e4m3 copies).
    """
    replaced = 0
    parents = [m for m in model.modules() if not isinstance(m, nn.Linear)]  # no reference kept to a replaced Linear
    for module in parents:
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child_name not in skip:
                setattr(module, child_name, Fp8Linear(child, keep_exact=keep_exact))
                replaced += 1
    return replaced


def fp8_linears(model: nn.Module) -> list[Fp8Linear]:
    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


@contextlib.contextmanager
def exact_linears(model: nn.Module) -> Iterator[None]:
    """Within: every ``Fp8Linear`` of ``model`` runs the exact matmul with its kept weight (a model without FP8
    Linears is exact already). Not for concurrent forwards: ``FrozenTarget``'s lock keeps others out."""
    linears = fp8_linears(model)
    missing = sum(m.exact_weight is None for m in linears)
    if missing:
        raise RuntimeError(
            f"{missing} of {len(linears)} FP8 Linears keep no exact weight: the exact target is gone "
            "(quantized without keep_exact, or released)"
        )
    for m in linears:
        m.exact = True
    try:
        yield
    finally:
        for m in linears:
            m.exact = False


def exact_bytes(model: nn.Module) -> int:
    """Bytes held by the kept exact weights of ``model``'s FP8 Linears (what ``release_exact`` would free)."""
    kept = [m.exact_weight for m in fp8_linears(model) if m.exact_weight is not None]
    return sum(w.numel() * w.element_size() for w in kept)


def release_exact(model: nn.Module) -> int:
    """Drops the kept exact weights (``exact_linears`` then refuses); returns the bytes they held."""
    freed = exact_bytes(model)
    for m in fp8_linears(model):
        m.exact_weight = None
    return freed
