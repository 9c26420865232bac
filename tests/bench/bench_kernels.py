"""Candidates issue 25's profile leaves, each timed alone against the engine's way (run on demand).

After the single weight cast the drafter's step and the target's forward are 78 % GEMMs, the drafter's at 95 % of
the measured peak and the target's at 87 %; what is left is the loss, attention and norms. Each part times two
ways on the engine's shapes and prints both, with how far their results are apart:

  loss    the drafter's loss of one TTT step (targets shifted 3 places, as at TTT step 2), compiled, forward and
          backward: the engine's (``loss._soft_cross_entropy``, one expression: ``lse(z) * sum(p) - sum(p * z)`` per
          position, p = exp(z_t - lse_t) from the target's bf16 logits and their fp32 lse, shifted inside the step)
          against the same on a float32 ``target_p`` (the engine's until session 10: 2.335 -> 1.896 ms on an H100),
          the two-pass form it had before session 4 (log_softmax, then the target-weighted sum: 1.929 -> 1.497 ms,
          kept then) and the Triton candidates of tests/bench/loss_kernels.py on the float32 target
          (``--loss-kernels KIND:BLOCK:WARPS``, CUDA only; one pass over each row, p read unshifted). Session 7:
          the ``block`` candidate 0.857 ms forward against 0.903 (dropped); session 10 (H100): ``lanes:1024:8``
          0.688 ms forward against 1.020, forward and backward 2.276 against 2.335 (dropped: the backward is the
          cost). Shape (batch, seq, draft vocab), bf16 logits.
  attention  the drafter's TTT attention at step i (keys of steps 0..i side by side), compiled, forward and
          backward: one flex call over the whole TTT mask (block 0 causal, a partial diagonal tile per later block
          and query tile) against the engine's ``merged`` attention (draft/merged.py: block 0 in cuDNN's or
          FlashAttention-2's fused causal kernel, the i diagonal keys merged in by log-sum-exp, the backward
          through the kernel's own with the merged lse), per step, each against a float32 dense-masked reference.
          (Session 4 timed flex over block 0 with its lse plus the merge: -0.52 / 0.66 / 0.55 ms at steps
          1 / 3 / 6, dropped; the kernel, not the diagonals, was the cost.) Flex is timed again with each of
          ``--flex-options`` (its Triton kernels' tiles, stages and TMA loads against inductor's defaults).
  mlp     the target's MLP and attention input projections at its shape, bf16: gate and up as two GEMMs (Hugging
          Face's Llama) against one GEMM over the two weights concatenated (as vLLM merges them), and q, k, v as
          three against one. The frozen target could hold merged copies; this says what they would save. Dropped:
          gate/up merged ran slower (759 -> 694 TFLOP/s), q/k/v 0.02 ms faster a layer.

  unroll  the drafter's whole TTT unroll (7 steps, forward and backward, bf16 cast once, compiled as the engine
          compiles it, flex attention): the engine's (q/k/v one matmul over the stacked weights, their embedding
          half made once and shifted per step) against every step projecting its own tokens through whole q, k
          and v (tests/support/drafter_reference.py, three matmuls a step, as the engine ran until session 6),
          both on the same batch, and each against a float32 eager reference (dense-mask SDPA): the worst
          relative error of the per-step losses and of any parameter's gradient. tests/device/run checks the
          engine's within 3 %. ``--unroll-fp8 RECIPE,...``: also the engine's step with the drafter's GEMMs in
          FP8 (drafter_fp8, engine/trainer/draft/fp8.py), each against the same float32 reference;
          ``--unroll-ways engine`` leaves the own-tokens steps out (one compile less).

Figures are CUDA-event times, median of ``--iters`` after ``--warm``; TFLOP/s for the GEMMs against 794 (bf16
8192^3 measured on the H200). ``--dry-run``: the CPU at small shapes (checks the code path and the agreement,
not a figure).

    python3 tests/bench/bench_kernels.py --out $OUT              (the H200: batch 4, seq 2048, 8B shapes)
    python3 tests/bench/bench_kernels.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # support.drafter_reference
sys.path.insert(0, str(REPO / "tests" / "bench"))  # loss_kernels

import torch  # noqa: E402

from engine.trainer.config import LOSS_MEAN_ALL  # noqa: E402
from engine.trainer.draft.loss import _soft_cross_entropy  # noqa: E402
from engine.trainer.draft.model import shift_left  # noqa: E402

PEAK_TFLOPS = 794.0


SHIFT = 3  # the loss part's TTT targets: target_p's rows this many places on (TTT step 2's)


def two_pass_loss(
    logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor | None, mean: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The engine's loss before session 4: log_softmax, then the target-weighted sum (two passes over the logits, a
    log-probabilities tensor between them), on target_p shifted as the TTT step shifts it."""
    m = mask.to(torch.float32)
    target_p = shift_left(target_p, SHIFT)
    logp = torch.log_softmax(logits.float(), dim=-1)
    summed = (-(target_p.float() * logp).sum(dim=-1) * m).sum()
    denominator = float(m.numel()) if mean == LOSS_MEAN_ALL else m.sum().clamp_min(1.0)
    hits = (logits.argmax(dim=-1) == target_p.argmax(dim=-1)).to(torch.float32) * m
    count = (loss_mask.to(torch.float32) if loss_mask is not None else m).sum()
    return summed / denominator, hits.sum(), count


def engine_loss(
    target_z: torch.Tensor, target_lse: torch.Tensor
) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The engine's loss as its TTT step runs it: on the target's bf16 logits over the draft vocabulary and their
    fp32 log-sum-exp, shifted inside the compiled step (lse +inf past the end: p = 0 there)."""

    def loss(
        logits: torch.Tensor, _target_p: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor | None, mean: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        z_t, lse_t = shift_left(target_z, SHIFT), shift_left(target_lse, SHIFT, float("inf"))
        return _soft_cross_entropy(logits, z_t, lse_t, mask, loss_mask, mean)

    return loss


def fp32_target_loss(
    logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor | None, mean: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The engine's loss until session 10: the same expression on a float32 ``target_p`` (twice the bytes a TTT step
    reads, forward and backward), shifted inside the step. H100, session 10: 2.335 ms forward and backward against
    1.896 for the bf16 logits with their lse (``bf16_target`` then, the engine's now)."""
    m = mask.to(torch.float32)
    z = logits.float()
    p = shift_left(target_p, SHIFT).float()
    per_position = torch.logsumexp(z, dim=-1) * p.sum(dim=-1) - (p * z).sum(dim=-1)
    summed = (per_position * m).sum()
    denominator = float(m.numel()) if mean == LOSS_MEAN_ALL else m.sum().clamp_min(1.0)
    hits = (logits.argmax(dim=-1) == p.argmax(dim=-1)).to(torch.float32) * m
    count = (loss_mask.to(torch.float32) if loss_mask is not None else m).sum()
    return summed / denominator, hits.sum(), count


def rows_loss(rows: Callable[..., Any]) -> Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The engine's loss made from a candidate's five row values (tests/bench/loss_kernels.py), p read unshifted."""

    def loss(
        logits: torch.Tensor, target_p: torch.Tensor, mask: torch.Tensor, loss_mask: torch.Tensor | None, mean: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = mask.to(torch.float32)
        lse, p_sum, pz, z_arg, p_arg = rows(logits, target_p, SHIFT)
        summed = ((lse * p_sum - pz) * m).sum()
        denominator = float(m.numel()) if mean == LOSS_MEAN_ALL else m.sum().clamp_min(1.0)
        hits = (z_arg == p_arg).to(torch.float32) * m
        count = (loss_mask.to(torch.float32) if loss_mask is not None else m).sum()
        return summed / denominator, hits.sum(), count

    return loss


def timer(device: torch.device) -> Callable[[Callable[[], Any], int, int], float]:
    def run(fn: Callable[[], Any], warm: int, iters: int) -> float:
        for _ in range(warm):
            fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1000.0)
        return statistics.median(times)

    return run


def part_loss(
    device: torch.device, b: int, t: int, v: int, warm: int, iters: int, compiled: bool, kernels: list[str]
) -> dict[str, Any]:
    import loss_kernels

    g = torch.Generator(device="cpu").manual_seed(0)
    logits0 = (torch.randn(b, t, v, generator=g) * 2).to(device, torch.bfloat16)
    target_z = (torch.randn(b, t, v, generator=g) * 3).to(device, torch.bfloat16)  # the target's bf16 logits
    target_p = torch.softmax(target_z.float(), dim=-1)  # fp32 (B, T, V): what the engine kept until session 10
    target_lse = torch.logsumexp(target_z.float(), dim=-1)  # the engine keeps the logits and this: (B, T)
    mask = (torch.rand(b, t, generator=g) > 0.1).float().to(device)
    run = timer(device)
    out: dict[str, Any] = {"part": "loss", "shape": [b, t, v], "shift": SHIFT, "compiled": compiled}
    ways: dict[str, Callable[..., Any]] = {
        "two_pass": two_pass_loss,
        "engine": engine_loss(target_z, target_lse),
        "fp32_target": fp32_target_loss,
    }
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the dry run can check the candidates' code path
    if (device.type == "cuda" or interpreted) and loss_kernels.KERNELS:
        for spec in kernels:  # kind:block:warps
            kind, block, warps = spec.split(":")
            rows = loss_kernels.candidate_rows(kind, int(block), int(warps))
            ways[f"kernel_{kind}_{block}_{warps}"] = rows_loss(rows)
    results: dict[str, tuple[torch.Tensor, ...]] = {}
    for name, fn in ways.items():
        step = torch.compile(fn) if compiled else fn
        logits = logits0.clone().requires_grad_(True)

        def fwd_bwd(step: Any = step, logits: torch.Tensor = logits) -> None:
            logits.grad = None
            loss, _, _ = step(logits, target_p, mask, mask, LOSS_MEAN_ALL)
            loss.backward()

        def fwd(step: Any = step, logits: torch.Tensor = logits) -> None:
            with torch.no_grad():
                step(logits, target_p, mask, mask, LOSS_MEAN_ALL)

        out[f"{name}_fwd_ms"] = run(fwd, warm, iters)
        out[f"{name}_fwd_bwd_ms"] = run(fwd_bwd, warm, iters)
        logits.grad = None
        loss, hits, count = step(logits, target_p, mask, mask, LOSS_MEAN_ALL)
        loss.backward()
        assert logits.grad is not None
        results[name] = (loss.detach(), hits.detach(), count.detach(), logits.grad.detach().float())
    l0, h0, c0, g0 = results["engine"]
    for name, (l1, h1, c1, g1) in results.items():
        if name == "engine":
            continue
        out[f"{name}_loss_rel_diff"] = abs(float(l1) - float(l0)) / max(abs(float(l0)), 1e-30)
        out[f"{name}_grad_rel_diff"] = float((g1 - g0).norm() / g0.norm())
        out[f"{name}_counts_equal"] = bool(torch.equal(h0, h1)) and bool(torch.equal(c0, c1))
        out[f"{name}_fwd_bwd_saved_ms_per_ttt_step"] = out["engine_fwd_bwd_ms"] - out[f"{name}_fwd_bwd_ms"]
    return out


def part_attention(
    device: torch.device,
    b: int,
    t: int,
    hq: int,
    hkv: int,
    d: int,
    steps: list[int],
    warm: int,
    iters: int,
    only: list[str] | None = None,
    flex_options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Each TTT step's attention, forward and backward, compiled as the engine compiles (static shapes): flex over
    the whole mask (the engine's) against ``merged`` with each fused kernel (on the CPU, the dry run: dense SDPA
    against merged, eager), and flex with each of ``flex_options`` (name -> flex's ``kernel_options``: Triton tile
    sizes, stages, TMA; CUDA only). Every candidate's output and gradients are compared with a float32 reference
    (dense-masked SDPA on the same inputs upcast), so a wrong candidate shows whichever one it is."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    from engine.trainer.draft.masks import BlockMaskCache, dense_ttt_mask
    from engine.trainer.draft.merged import merged_ttt_attention

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    run = timer(device)
    masks = BlockMaskCache()
    gqa = hq != hkv

    def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i: int) -> torch.Tensor:
        rep = hq // hkv  # keys repeated to the query heads, so SDPA keeps a fused kernel for the mask
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=dense_ttt_mask(t, i, device)
        )

    def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)

    def flex_with(options: dict[str, Any]) -> Callable[..., torch.Tensor]:
        return lambda q, k, v, mask: flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa, kernel_options=options)

    def merged(backend: str) -> Callable[..., torch.Tensor]:
        return lambda q, k, v, mask: merged_ttt_attention(q, k, v, backend)

    if cuda:
        fns: dict[str, Any] = {
            "flex": torch.compile(flex, dynamic=False),
            "merged_cudnn": torch.compile(merged("cudnn"), dynamic=False),
            "merged_flash": torch.compile(merged("flash"), dynamic=False),
            "merged_cudnn_eager": merged("cudnn"),
        }
        for name, options in (flex_options or {}).items():
            fns[f"flex_{name}"] = torch.compile(flex_with(options), dynamic=False)
        baseline = "flex"
    else:
        fns = {"sdpa": lambda q, k, v, mask: dense(q, k, v, mask), "merged_cpu": merged("cpu")}
        baseline = "sdpa"
    if only:
        fns = {name: fn for name, fn in fns.items() if name in only}
    out: dict[str, Any] = {"part": "attention", "shape": [b, hq, hkv, t, d], "baseline": baseline, "steps": {}}
    for i in steps:
        q0 = torch.randn(b, t, hq, d, generator=g).to(device, dtype).transpose(1, 2)  # the projections' layout
        k0 = torch.randn(b, hkv, (i + 1) * t, d, generator=g).to(device, dtype)
        v0 = torch.randn(b, hkv, (i + 1) * t, d, generator=g).to(device, dtype)
        dout = torch.randn(b, t, hq, d, generator=g).to(device, dtype).transpose(1, 2)
        q, k, v = (x.detach().float().requires_grad_(True) for x in (q0, k0, v0))
        o = dense(q, k, v, i)
        o.backward(dout.float())
        reference = [o.detach(), *(x.grad.detach() for x in (q, k, v) if x.grad is not None)]
        del q, k, v, o
        row: dict[str, Any] = {}
        for name, fn in fns.items():
            q, k, v = (x.detach().clone().requires_grad_(True) for x in (q0, k0, v0))
            mask = masks.get(device, t, i) if name.startswith("flex") else i  # made outside the compiled call

            def fwd_bwd(fn: Any = fn, q: Any = q, k: Any = k, v: Any = v, mask: Any = mask, dout: Any = dout) -> None:
                q.grad = k.grad = v.grad = None
                fn(q, k, v, mask).backward(dout)

            try:
                row[f"{name}_fwd_bwd_ms"] = run(fwd_bwd, warm, iters)
                q.grad = k.grad = v.grad = None
                o = fn(q, k, v, mask)
                o.backward(dout)
            except Exception as exc:  # a kernel this build or GPU lacks: recorded, the other candidates still run
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                continue
            got = [o.detach().float()] + [x.grad.detach().float() for x in (q, k, v) if x.grad is not None]
            row[f"{name}_rel_err_out_dq_dk_dv"] = [
                float((m - e).norm() / e.norm()) for e, m in zip(reference, got, strict=True)
            ]
            if name != baseline and f"{baseline}_fwd_bwd_ms" in row:
                row[f"{name}_saved_ms"] = row[f"{baseline}_fwd_bwd_ms"] - row[f"{name}_fwd_bwd_ms"]
        out["steps"][str(i)] = row
        print(f"attention step {i}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return out


def part_mlp(device: torch.device, tokens: int, h: int, inter: int, q: int, kv: int, warm: int, iters: int) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)

    def w(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * 0.02).to(device, dtype)

    x = (torch.randn(tokens, h, generator=g)).to(device, dtype)
    gate, up = w(inter, h), w(inter, h)
    wq, wk, wv = w(q, h), w(kv, h), w(kv, h)
    gate_up = torch.cat((gate, up))
    qkv = torch.cat((wq, wk, wv))
    run = timer(device)
    F = torch.nn.functional
    out: dict[str, Any] = {"part": "mlp", "tokens": tokens, "hidden": h, "intermediate": inter, "q": q, "kv": kv}
    pairs = {
        "gate_up": (lambda: (F.linear(x, gate), F.linear(x, up)), lambda: F.linear(x, gate_up).chunk(2, dim=-1)),
        "qkv": (
            lambda: (F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)),
            lambda: F.linear(x, qkv).split([q, kv, kv], dim=-1),
        ),
    }
    flops = {"gate_up": 2 * tokens * h * 2 * inter, "qkv": 2 * tokens * h * (q + 2 * kv)}
    for name, (separate, merged) in pairs.items():
        a = run(separate, warm, iters)
        m = run(merged, warm, iters)
        out[f"{name}_separate_ms"], out[f"{name}_merged_ms"] = a, m
        out[f"{name}_separate_tflops"] = flops[name] / a / 1e9
        out[f"{name}_merged_tflops"] = flops[name] / m / 1e9
        diff = max(
            float((t.float() - s.float()).norm() / s.float().norm()) for s, t in zip(separate(), merged(), strict=True)
        )
        out[f"{name}_rel_diff"] = diff  # another GEMM kernel may sum in another order: not always bit for bit
    # The target's 32 layers, one forward: what merging both would save a step.
    out["saved_ms_per_forward_32_layers"] = 32 * (
        out["gate_up_separate_ms"] - out["gate_up_merged_ms"] + out["qkv_separate_ms"] - out["qkv_merged_ms"]
    )
    out["peak_tflops"] = PEAK_TFLOPS
    return out


def unroll_batch_for(device: torch.device) -> int:
    """The unroll's batch that fits the card: its float32 reference keeps ~26 GiB of dense attention a sequence."""
    if device.type != "cuda":
        return 2
    return 2 if torch.cuda.get_device_properties(device).total_memory >= 120 * 2**30 else 1


def part_unroll(
    device: torch.device,
    b: int,
    t: int,
    shape: dict[str, int],
    steps: int,
    warm: int,
    iters: int,
    compiled: bool,
    variants: list[tuple[str, bool]],
    fp8_recipes: tuple[str, ...] = (),
    way_names: tuple[str, ...] = ("engine", "own_tokens"),
) -> dict[str, Any]:
    from support.drafter_reference import own_tokens_step, step_embeddings

    from engine.trainer.draft.attention import TTTAttention
    from engine.trainer.draft.loss import soft_cross_entropy, total_loss
    from engine.trainer.draft.model import DraftConfig, Drafter, ttt_step
    from engine.trainer.draft.rows import trained_rows
    from engine.trainer.threads.compile import GuardedFunction, apply_dynamo_config, compile_guard

    apply_dynamo_config()
    cfg = DraftConfig(**shape)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.device(device):
        torch.manual_seed(0)
        drafter = Drafter(cfg, torch.randn(cfg.vocab_size, cfg.hidden_size), torch.arange(cfg.draft_vocab_size) * 3)
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g).to(device)
    hidden3 = torch.randn(b, t, 3 * cfg.hidden_size, generator=g).to(device)
    target_z = torch.randn(b, t, cfg.draft_vocab_size, generator=g) * 3
    target_lse = torch.logsumexp(target_z, dim=-1).to(device)
    target_z = target_z.to(device)
    mask = (torch.rand(b, t, generator=g) > 0.1).float().to(device)
    embeddings = step_embeddings(ids, drafter.embed_table, steps)
    # The engine's step gathers the rows each TTT step trains (head_positions "trained", draft/rows.py); the float32
    # reference runs the head and the loss on every position, as SpecForge does.
    rows = trained_rows(mask, None, steps)
    fast = TTTAttention("flex" if device.type == "cuda" else "sdpa", compiled=compiled)
    ways = {
        "engine": (GuardedFunction(ttt_step, compiled=compiled, name="ttt_step"), "off"),
        "own_tokens": (GuardedFunction(own_tokens_step(embeddings), compiled=compiled, name="own_tokens_step"), "off"),
    }
    ways = {name: way for name, way in ways.items() if name in way_names}
    for recipe in fp8_recipes:  # the engine's step on FP8 GEMMs: a graph of its own (its weights are Fp8Weights)
        ways[f"fp8_{recipe}"] = (GuardedFunction(ttt_step, compiled=compiled, name=f"ttt_step_fp8_{recipe}"), recipe)

    def unroll(
        step_fn: Any, attention: TTTAttention, bf16: bool, fp8: str = "off", on_rows: bool = True
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        drafter.zero_grad(set_to_none=True)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
        with autocast:
            losses, _, _ = drafter(
                hidden3.to(torch.bfloat16) if bf16 else hidden3,
                ids,
                target_z,
                target_lse,
                mask,
                ttt_steps=steps,
                attention=attention,
                loss_fn=soft_cross_entropy,
                step_fn=step_fn,
                loss_mask=mask,
                weight_dtype=torch.bfloat16 if bf16 else None,
                fp8=fp8,
                rows=rows if on_rows else None,
            )
        total_loss(losses).backward()
        return losses.detach().float(), {n: p.grad.float() for n, p in drafter.named_parameters() if p.grad is not None}

    out: dict[str, Any] = {"part": "unroll", "batch": b, "seq": t, "ttt_steps": steps, "shape": shape}
    run = timer(device)
    got = {}
    for name, (fn, recipe) in ways.items():
        with compile_guard():
            got[name] = unroll(fn, fast, bf16=True, fp8=recipe)
        out[f"{name}_fwd_bwd_ms"] = run(lambda fn=fn, recipe=recipe: unroll(fn, fast, True, recipe), warm, iters)
    for impl, compiled_step in variants:  # diagnosis: the engine's step with another attention, or eager
        attention = TTTAttention(impl, compiled=compiled_step)
        fn = GuardedFunction(ttt_step, compiled=compiled_step, name=f"ttt_step_{impl}")
        with compile_guard():
            got[f"{impl}_{'compiled' if compiled_step else 'eager'}"] = unroll(fn, attention, bf16=True)
    ref_losses, ref_grads = unroll(None, TTTAttention("sdpa"), bf16=False, on_rows=False)
    for name, (losses, grads) in got.items():
        out[f"{name}_loss_rel_err"] = float(((losses - ref_losses).abs() / ref_losses.abs().clamp_min(1e-30)).max())
        errs = {n: float((grads[n] - r).norm() / r.norm().clamp_min(1e-30)) for n, r in ref_grads.items()}
        worst = max(errs, key=lambda n: errs[n])
        out[f"{name}_grad_rel_err_worst"] = [worst, errs[worst]]
        out[f"{name}_grad_rel_err"] = {n: round(e, 5) for n, e in errs.items()}
        out[f"{name}_params_with_grads"] = len(grads)
    out["params_with_grads_reference"] = len(ref_grads)
    if "own_tokens" in ways and "engine" in ways:
        out["saved_ms"] = out["own_tokens_fwd_bwd_ms"] - out["engine_fwd_bwd_ms"]
    return out


# flex's Triton kernels with other settings than inductor's defaults for the H200 at head dim 128, bf16 (torch 2.11:
# forward tiles 128 x 64, 3 stages, 8 warps; backward 64/128/128/64, 3 stages, 8 warps; no TMA on CUDA). The
# drafter's flex backward is its longest non-GEMM kernel (14.3 ms of a 428 ms step, forward 5.2 ms: session 7).
FLEX_OPTIONS: dict[str, dict[str, Any]] = {
    "tma": {"USE_TMA": True},  # tensor-memory-accelerator loads (Hopper); inductor turns them on for XPU only
    "fwd_n128": {"fwd_BLOCK_N": 128, "fwd_num_stages": 2},  # 3 stages of 128 x 128 K, V tiles: ~224 KB shared
    "bwd_stages2": {"bwd_num_stages": 2},
    "tma_bwd_stages2": {"USE_TMA": True, "bwd_num_stages": 2},
}


def parse_flex_options(text: str) -> dict[str, dict[str, Any]]:
    """``NAME=JSON;NAME=JSON`` -> {name: kernel_options}; SystemExit(2) naming the bad entry."""
    out: dict[str, dict[str, Any]] = {}
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        name, sep, body = entry.partition("=")
        try:
            options = json.loads(body) if sep and name.isidentifier() else None
        except json.JSONDecodeError:
            options = None
        if not isinstance(options, dict):
            print(f"bench_kernels: --flex-options entry {entry!r} is not NAME={{json object}}", file=sys.stderr)
            raise SystemExit(2)
        out[name] = options
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="loss,attention,mlp", help="also: unroll (a whole compiled unroll: minutes)")
    ap.add_argument(
        "--unroll-batch",
        type=int,
        default=0,
        help="unroll: sequences a step (the float32 reference's dense masks); 0: sized to the card (2 from 120 GiB, "
        "else 1: batch 2 ran out of memory on an 80 GB H100)",
    )
    ap.add_argument(
        "--loss-kernels",
        default="block:2048:8,lanes:1024:4,lanes:2048:8,lanes:1024:8",
        help="loss: the Triton candidates of tests/bench/loss_kernels.py as KIND:BLOCK:WARPS (CUDA only)",
    )
    ap.add_argument(
        "--unroll-variants", default="", help="unroll: also the engine's step with IMPL:compiled|IMPL:eager attention"
    )
    ap.add_argument(
        "--unroll-fp8", default="", help="unroll: also the engine's step with drafter_fp8 = each RECIPE (comma list)"
    )
    ap.add_argument("--unroll-ways", default="engine,own_tokens", help="unroll: the bf16 ways timed (comma-separated)")
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--attention-shape", default="", help="attention: B,HQ,HKV,T,D instead of the 8B drafter's")
    ap.add_argument("--attention-steps", default="0,1,6", help="attention: the TTT steps timed")
    ap.add_argument("--attention-only", default="", help="attention: these candidates only (comma-separated)")
    ap.add_argument(
        "--flex-options",
        default=";".join(f"{n}={json.dumps(o, separators=(',', ':'))}" for n, o in FLEX_OPTIONS.items()),
        help="attention: flex again with each NAME=JSON kernel_options (';'-separated; CUDA only)",
    )
    ap.add_argument("--dry-run", action="store_true", help="the CPU at small shapes: the code path, not a figure")
    ap.add_argument("--out", type=Path, default=None, help="write kernels.json here")
    a = ap.parse_args()
    if a.dry_run:
        device, b, t, v, tokens, h, inter, q, kv = torch.device("cpu"), 2, 64, 512, 128, 64, 176, 64, 16
        compiled = False
    else:
        if not torch.cuda.is_available():
            print("bench_kernels: no CUDA device (use --dry-run on the CPU)", file=sys.stderr)
            return 2
        device, b, t, v, tokens, h, inter, q, kv = torch.device("cuda"), 4, 2048, 32000, 8192, 4096, 14336, 4096, 1024
        compiled = True
    results = []
    for part in a.parts.split(","):
        if part == "loss":
            kernels = a.loss_kernels.split(",") if a.loss_kernels else []
            res = part_loss(device, b, t, v, a.warm, a.iters, compiled, kernels)
        elif part == "attention":
            shape = [b, 32, 8, t, 128] if device.type == "cuda" else [b, 8, 2, t, 16]
            if a.attention_shape:
                shape = [int(x) for x in a.attention_shape.split(",")]
            steps = [int(x) for x in a.attention_steps.split(",")]
            only = [x for x in a.attention_only.split(",") if x]
            options = parse_flex_options(a.flex_options)
            res = part_attention(
                device, shape[0], shape[3], shape[1], shape[2], shape[4], steps, a.warm, a.iters, only, options
            )
        elif part == "mlp":
            res = part_mlp(device, tokens, h, inter, q, kv, a.warm, a.iters)
        elif part == "unroll":
            heads = (32, 8, 128) if device.type == "cuda" else (4, 2, 16)
            shape = {
                "hidden_size": h,
                "num_heads": heads[0],
                "num_kv_heads": heads[1],
                "head_dim": heads[2],
                "intermediate_size": inter,
                "vocab_size": 128256 if device.type == "cuda" else 4 * v,
                "draft_vocab_size": v,
            }
            variants = [(x.split(":")[0], x.endswith(":compiled")) for x in a.unroll_variants.split(",") if x]
            batch = a.unroll_batch or unroll_batch_for(device)
            recipes = tuple(x for x in a.unroll_fp8.split(",") if x)
            ways = tuple(x for x in a.unroll_ways.split(",") if x)
            res = part_unroll(device, batch, t, shape, 7, a.warm, a.iters, compiled, variants, recipes, ways)
        else:
            print(f"bench_kernels: unknown part {part!r} (loss, attention, mlp, unroll)", file=sys.stderr)
            return 2
        res["device"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        res["dry_run"] = a.dry_run
        print("RESULT " + json.dumps(res), flush=True)
        results.append(res)
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "kernels.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
