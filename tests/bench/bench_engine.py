"""Throughput of the engine against a plain single-thread sequential loop, on one GPU.

Llama-3.1-8B-shaped random target (bf16, HF SDPA), EAGLE-3 drafter (~425M trainable params), seq 2048,
TTT 7, draft vocab 32k, batch 1. Each mode runs in its own subprocess (fresh memory and compile caches):

  baseline  plain loop, one thread, default stream: target forward, then drafter forward/backward/AdamW;
            no compile, dense SDPA masks (the TTT mask materialised).
  sides     the two sides alone: target forward only, and the drafter step alone (compiled flex, block-sparse
            mask, compiled loss) on a fixed batch -> per-GPU rates and the suggested target/drafter split.
  engine    the engine itself (producer thread + drafter thread, own CUDA streams, compile guard, warm-up);
            with --set drafter_devices/target_devices over two GPUs: the threaded single-process layout.
  profile   where the time goes: the target forward and the drafter step (the engine's worker step) each
            alone under torch.profiler, every CUDA kernel put in a category (GEMM, flex attention forward and
            backward, Triton fusions: norms/rotary/loss, optimizer, copies, other ATen) with its share; the
            drafter's forward per TTT step and backward between TTT steps by CUDA events.
  ranks     the engine as torchrun ranks (--nproc N, one rank per GPU, NCCL; N = 1 is the NCCL code path with
            world size 1): tok/s summed over the ranks, and whether the drafter weights are equal on every
            rank at the end (each rank's digest in <output_dir>/ranks/).

MFU (per GPU) = model FLOPs per step / step time / GPUs used / 794e12 (bf16 8192^3 matmul measured on this
H200). Model FLOPs:
  target  = 2*T*(P_layers + H*V) + L * 4*hd*nh * T(T+1)/2               (causal pairs only)
  drafter = 3 * [2*T*3H*H + sum_i (2*T*(P_layer + H*Vd) + 4*hd*nh*(T(T+1)/2 + i*T))]
            (backward = 2x forward; attention counts only the unmasked pairs of the TTT mask)

    python3 tests/bench/bench_engine.py all --out DIR
    python3 tests/bench/bench_engine.py all --batch 2 --plan 'engine;engine --set drafter_devices=["cuda:0","cuda:1"]
        --set target_devices=["cuda:0","cuda:1"];ranks --nproc 2'     (the two-GPU layouts, one line)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

PEAK_TFLOPS = 794.0
SEQ = 2048
TTT = 7
DRAFT_VOCAB = 32000
BATCH = 1  # sequences per step for the baseline and the sides (--batch); the engine gets the same batch_size


def flops(tcfg: Any, dcfg: Any, seq: int, ttt: int, batch: int) -> dict[str, float]:
    h, v, L = tcfg.hidden_size, tcfg.vocab_size, tcfg.num_hidden_layers
    nh, nkv = tcfg.num_attention_heads, tcfg.num_key_value_heads
    hd = getattr(tcfg, "head_dim", None) or h // nh
    inter = tcfg.intermediate_size
    p_layer_t = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * inter
    causal = seq * (seq + 1) / 2
    target = batch * (2 * seq * (L * p_layer_t + h * v) + L * 4 * hd * nh * causal)
    dh, dnh, dnkv, dhd = dcfg.hidden_size, dcfg.num_heads, dcfg.num_kv_heads, dcfg.head_dim
    p_layer_d = 2 * dh * dnh * dhd + 2 * (2 * dh * dnkv * dhd) + dnh * dhd * dh + 3 * dh * dcfg.intermediate_size
    fwd = 2 * seq * 3 * dh * dh
    for i in range(ttt):
        fwd += 2 * seq * (p_layer_d + dh * dcfg.draft_vocab_size) + 4 * dhd * dnh * (causal + i * seq)
    return {"target": target, "drafter": 3 * fwd * batch}


TARGET_ONLY = False  # profile --target-only: the target forward alone (no drafter compile)
DRY = False  # --dry-run: the baseline and profile modes on the CPU with the tiny target (the code path, not a figure)
CAST_ONCE = True  # the sides' and profile's drafter worker casts its weights once (--set cast_weights_once=false)
FP8 = False  # the sides' and profile's target with FP8 decoder Linears (--set target_fp8=true; CUDA with FP8 only)
HEAD_POSITIONS = "trained"  # the sides' and profile's drafter head and loss rows (--set head_positions="all")
DRAFTER_FP8 = "off"  # the sides' and profile's drafter GEMMs (--set drafter_fp8="rowwise"; engine/trainer/draft/fp8.py)
DRAFTER_FP8_MLP = "composed"  # and their MLP under it (--set drafter_fp8_mlp="fused"; engine/trainer/draft/fp8_mlp.py)


def build_parts(compiled: bool, attn: str) -> dict[str, Any]:
    import torch

    from engine.trainer.data.sources import RandomTokenSource
    from engine.trainer.data.vocab import build_draft_vocab
    from engine.trainer.draft.attention import TTTAttention
    from engine.trainer.draft.model import DraftConfig, Drafter
    from engine.trainer.verifier.model import load_target

    dev = torch.device("cpu" if DRY else "cuda:0")
    t0 = time.perf_counter()
    if DRY:
        from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

        target = load_target(
            "tiny", dev, tokenizer=build_tiny_tokenizer(), layer_ids=None, seed=0, dtype=torch.bfloat16
        )
    else:
        target = load_target(
            "llama3-8b-shape", dev, tokenizer=None, layer_ids=None, seed=0, dtype=torch.bfloat16, fp8=FP8
        )
    if not DRY:
        torch.cuda.synchronize()
    load_s = time.perf_counter() - t0
    source = RandomTokenSource(target.vocab_size, buckets=[SEQ], batch_size=BATCH, seed=0)
    vocab = build_draft_vocab(source, target.vocab_size, DRAFT_VOCAB)
    dcfg = DraftConfig.from_target(target.config, vocab.size)
    with torch.device(dev):
        torch.manual_seed(0)
        drafter = Drafter(dcfg, target.embed_weight(), vocab.draft_to_target.to(dev))
    return {
        "torch": torch,
        "dev": dev,
        "target": target,
        "source": source,
        "vocab": vocab,
        "dcfg": dcfg,
        "drafter": drafter,
        "attention": TTTAttention(attn, compiled=compiled),
        "load_s": load_s,
    }


def mode_baseline(steps: int, warm: int) -> dict[str, Any]:
    parts = build_parts(compiled=False, attn="sdpa")
    torch, dev, target, drafter = parts["torch"], parts["dev"], parts["target"], parts["drafter"]
    from engine.trainer.draft.loss import soft_cross_entropy, total_loss

    draft_ids = parts["vocab"].draft_to_target.to(dev)
    t2d = parts["vocab"].t2d(target.vocab_size).to(dev)
    params = drafter.trainable_parameters()
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), fused=True)
    rows = []
    for i in range(warm + steps):
        hb = parts["source"].batch(i)
        ids, mask = hb.input_ids.to(dev), hb.loss_mask.to(dev)
        e0, e1, e2 = (timing_event() for _ in range(3))
        w0 = time.perf_counter()
        e0.record()
        out = target.run(ids, mask, draft_ids, t2d)
        e1.record()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            losses, _, _ = drafter(
                out.hidden3,
                ids,
                out.target_logits,
                out.target_lse,
                out.position_mask,
                ttt_steps=TTT,
                attention=parts["attention"],
                loss_fn=soft_cross_entropy,
            )
        total_loss(losses).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        e2.record()
        if not DRY:
            torch.cuda.synchronize()
        if i >= warm:
            rows.append((time.perf_counter() - w0, e0.elapsed_time(e1), e1.elapsed_time(e2)))
    n = len(rows)
    step_ms = 1000 * sum(r[0] for r in rows) / n
    f = flops(target.config, parts["dcfg"], SEQ, TTT, BATCH)
    return {
        "mode": f"baseline batch_size={BATCH}",
        "batch_size": BATCH,
        "step_ms": step_ms,
        "target_ms": sum(r[1] for r in rows) / n,
        "drafter_ms": sum(r[2] for r in rows) / n,
        "tok_s": SEQ * BATCH / (step_ms / 1000),
        "mfu": (f["target"] + f["drafter"]) / (step_ms / 1000) / (PEAK_TFLOPS * 1e12),
        "peak_gib": None if DRY else torch.cuda.max_memory_allocated() / 2**30,
        "drafter_params_m": sum(p.numel() for p in params) / 1e6,
        "flops": f,
        "target_load_s": parts["load_s"],
    }


def trained_share(position_mask: Any) -> list[float]:
    """Per TTT step, the share of the batch's positions it trains (what head_positions "trained" computes the
    head and the loss on). Random tokens through a random target: the target's top token lands in the draft
    vocabulary about DRAFT_VOCAB / vocab of the time (a trained target on real text: most of the time)."""
    from engine.trainer.draft.rows import trained_rows

    rows = trained_rows(position_mask, None, TTT)
    return [round(c / position_mask.numel(), 4) for c in rows.counts]


def bench_worker(parts: dict[str, Any], step_fn: Any) -> Any:
    """The engine's DrafterWorker on ``parts``' drafter alone: fused AdamW, bf16 autocast, one bucket, no queue."""
    import torch

    from engine.trainer.data.dispatch import IndexLedger
    from engine.trainer.draft.fp8 import weight_layouts
    from engine.trainer.run.worker import DrafterTraining, DrafterWorker, WorkerLinks, WorkerSettings
    from engine.trainer.threads.compile import GuardedFunction
    from engine.trainer.threads.control import ThreadControl
    from engine.trainer.threads.health import HealthBoard
    from engine.trainer.threads.metrics import EventLog
    from engine.trainer.threads.queue import BoundedQueue

    # The engine's human lines (stage=..., step=...) to stderr: a mode that runs past --timeout-s shows in its record
    # how far it got (the build, the warm-up, which step); stdout keeps the RESULT line alone.
    events = EventLog(None, stdout=sys.stderr)
    control = ThreadControl(events, HealthBoard(events, stall_after_s=60, starve_after_s=60), "stop")
    opt = torch.optim.AdamW(parts["drafter"].trainable_parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    training = DrafterTraining(
        parts["drafter"],
        parts["dev"],
        opt,
        sched,
        parts["attention"],
        step_fn,
        hidden_dtype=torch.bfloat16,
        autocast_dtype=torch.bfloat16,
        # drafter_fp8: the weights' quantisation compiled, as the engine's fp8_layouts runs it on CUDA (eager dry)
        fp8_layouts=GuardedFunction(weight_layouts, compiled=not DRY, name="fp8_weights")
        if DRAFTER_FP8 != "off"
        else None,
    )
    settings = WorkerSettings(
        ttt_steps=TTT,
        total_steps=10**9,
        buckets=(SEQ,),
        batch_size=BATCH,
        cast_weights_once=CAST_ONCE,
        head_positions=HEAD_POSITIONS,
        drafter_fp8=DRAFTER_FP8,
        drafter_fp8_mlp=DRAFTER_FP8_MLP,
    )
    return DrafterWorker("drafter0", 0, training, settings, WorkerLinks(BoundedQueue(1), control, IndexLedger()))


def mode_sides(steps: int, warm: int, compile_target: bool) -> dict[str, Any]:
    parts = build_parts(compiled=True, attn="flex")
    torch, dev, target = parts["torch"], parts["dev"], parts["target"]
    from engine.trainer.draft.model import ttt_step
    from engine.trainer.run.producer import DeviceBatch
    from engine.trainer.threads.compile import GuardedFunction, apply_dynamo_config
    from engine.trainer.threads.metrics import suggest_split

    apply_dynamo_config()
    draft_ids = parts["vocab"].draft_to_target.to(dev)
    t2d = parts["vocab"].t2d(target.vocab_size).to(dev)
    if compile_target:
        target.compile()
    # Target side alone.
    hb = parts["source"].batch(0)
    ids, mask = hb.input_ids.to(dev), hb.loss_mask.to(dev)
    t0 = time.perf_counter()
    out = target.run(ids, mask, draft_ids, t2d)
    torch.cuda.synchronize()
    target_first_s = time.perf_counter() - t0
    for _ in range(warm):
        target.run(ids, mask, draft_ids, t2d)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        target.run(ids, mask, draft_ids, t2d)
    torch.cuda.synchronize()
    target_ms = 1000 * (time.perf_counter() - t0) / steps
    target_gib = torch.cuda.max_memory_allocated() / 2**30  # the target's weights and one batch's activations
    # Drafter side alone, through the engine's worker step (compiled flex + loss).
    worker = bench_worker(parts, GuardedFunction(ttt_step, compiled=True, name="ttt_step"))
    warm_s = worker.warm_up()
    batch = DeviceBatch(
        0, SEQ, ids, out.hidden3, out.target_logits, out.target_lse, out.position_mask, loss_mask=out.loss_mask
    )
    for _ in range(warm):
        worker.train_step(batch, 0.0)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    phase = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0}
    for _ in range(steps):
        res, _ = worker.train_step(batch, 0.0)
        for k in phase:
            phase[k] += res.ms[k] / steps
    torch.cuda.synchronize()
    drafter_ms = 1000 * (time.perf_counter() - t0) / steps
    drafter_gib = torch.cuda.max_memory_allocated() / 2**30 - target_gib  # what the drafter's training added
    gpu_gib = torch.cuda.get_device_properties(dev).total_memory / 2**30
    f = flops(target.config, parts["dcfg"], SEQ, TTT, BATCH)
    t_rate, d_rate = SEQ / (target_ms / 1000), SEQ / (drafter_ms / 1000)
    return {
        "mode": "sides" + ("+compiled-target" if compile_target else ""),
        "target_ms": target_ms,
        "target_first_call_s": target_first_s,
        "target_tok_s_per_gpu": t_rate,
        "target_mfu": f["target"] / (target_ms / 1000) / (PEAK_TFLOPS * 1e12),
        "drafter_ms": drafter_ms,
        "drafter_phase_ms": phase,
        "drafter_warmup_s": warm_s,
        "drafter_tok_s_per_gpu": d_rate,
        "drafter_mfu": f["drafter"] / (drafter_ms / 1000) / (PEAK_TFLOPS * 1e12),
        "sequential_sum_tok_s": SEQ / ((target_ms + drafter_ms) / 1000),
        "layout": {
            str(n): dataclasses.asdict(
                suggest_split(t_rate, d_rate, n, target_gib=target_gib, drafter_gib=drafter_gib, gpu_gib=gpu_gib)
            )
            for n in (2, 4, 8)
        },
        "trained_share": trained_share(out.position_mask),
        "target_gib": target_gib,
        "drafter_gib": drafter_gib,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


KERNEL_CATEGORIES = (
    ("attention_bwd", ("flex_attention_backward", "flex_backward", "attention_backward", "flash_bwd", "bprop")),
    # cuDNN's SDPA kernels carry sm90/wgmma in their names too: matched here, before the GEMMs
    ("attention_fwd", ("flex_attention", "tem_fused", "flash_fwd", "fmha", "sdpa", "fprop", "attention")),
    ("comm", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor", "foreach", "fused_sgd")),
    ("gemm", ("gemm", "sm90_", "sm100_", "xmma", "cutlass", "nvjet", "cublas", "wgmma", "splitk", "matmul")),
    ("triton_fused", ("triton_",)),
    ("memory", ("memcpy", "memset")),
)


def kernel_category(name: str) -> str:
    """The category of one CUDA kernel by its name (first match in KERNEL_CATEGORIES; else ``other_aten``)."""
    n = name.lower()
    for category, needles in KERNEL_CATEGORIES:
        if any(needle in n for needle in needles):
            return category
    return "other_aten"


def kernel_times(prof: Any, calls: int, main_range: str | None = None) -> dict[str, Any]:
    """Per-call GPU time of a profile's kernels: by category (ms and share) and the 15 longest kernels.

    ``main_range``: a record_function range the calling thread opened around each call; kernels launched
    from that thread are ``forward`` (forward and optimizer), from any other (autograd's) ``backward``.
    """
    import torch

    cpu, want = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    if DRY:  # the dry run counts CPU ops (nested ones twice): it checks the code path, not a breakdown
        want = cpu
    events = list(prof.profiler.kineto_results.events())
    launcher: dict[int, int] = {}  # correlation id -> the launching thread
    main_tid = None
    for ev in events:
        if ev.device_type() == cpu:
            launcher[ev.correlation_id()] = ev.start_thread_id()
            if main_range is not None and ev.name() == main_range:
                main_tid = ev.start_thread_id()
    by_name: dict[str, list[float]] = {}
    by_phase: dict[str, dict[str, float]] = {}
    for ev in events:
        if ev.device_type() != want or getattr(ev, "is_user_annotation", lambda: False)():
            continue
        ms = ev.duration_ns() / 1e6 / calls
        slot = by_name.setdefault(ev.name(), [0.0, 0.0])
        slot[0] += ms
        slot[1] += 1.0 / calls
        if main_tid is not None and not DRY:
            tid = launcher.get(ev.linked_correlation_id(), launcher.get(ev.correlation_id()))
            phase = "unknown" if tid is None else "forward" if tid == main_tid else "backward"
            cat = by_phase.setdefault(phase, {})
            cat[kernel_category(ev.name())] = cat.get(kernel_category(ev.name()), 0.0) + ms
    cats: dict[str, float] = {}
    for name, (ms, _n) in by_name.items():
        cats[kernel_category(name)] = cats.get(kernel_category(name), 0.0) + ms
    total = sum(cats.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    top = ranked[:15]
    top_other = [kv for kv in ranked if kernel_category(kv[0]) != "gemm"][:25]
    order = sorted(cats.items(), key=lambda kv: -kv[1])
    return {
        "kernel_ms": total,
        "by_category_ms": {k: round(v, 2) for k, v in order},
        "by_category_share": {k: round(v / total, 3) for k, v in order} if total else {},
        "by_launching_thread_ms": {
            phase: {k: round(v, 2) for k, v in sorted(cat.items(), key=lambda kv: -kv[1])}
            for phase, cat in by_phase.items()
        },
        "top_kernels": [
            {"name": name[:110], "ms": round(ms, 2), "per_call": round(n, 1), "category": kernel_category(name)}
            for name, (ms, n) in top
        ],
        "top_non_gemm_kernels": [
            {"name": name[:110], "ms": round(ms, 2), "per_call": round(n, 1), "category": kernel_category(name)}
            for name, (ms, n) in top_other
        ],
    }


class TimedStep:
    """A TTT step function wrapped with CUDA events: each call's forward time, and the backward between steps
    (a hook on each step's hidden-state output fires when the backward reaches that step)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.fwd: list[Any] = []  # (start, end) event pairs, one per TTT step, this step
        self.bwd: list[Any] = []  # one event per hidden-state gradient, in backward order
        self.active = False

    def __getattr__(self, name: str) -> Any:  # mark_warm, compiled, ... of the wrapped GuardedFunction
        return getattr(self.fn, name)

    def __call__(self, *args: Any) -> Any:
        if not self.active:
            return self.fn(*args)
        start, end = timing_event(), timing_event()
        start.record()
        out = self.fn(*args)
        end.record()
        self.fwd.append((start, end))
        hidden = out[0]
        if hidden.requires_grad:

            def hook(grad: Any) -> None:
                ev = timing_event()
                ev.record()
                self.bwd.append(ev)

            hidden.register_hook(hook)
        return out


class _WallEvent:
    """torch.cuda.Event's record/elapsed_time on the host clock (the CPU dry run)."""

    t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: _WallEvent) -> float:
        return (other.t - self.t) * 1000.0


def timing_event() -> Any:
    import torch

    return _WallEvent() if DRY else torch.cuda.Event(enable_timing=True)


def mode_profile(steps: int, warm: int) -> dict[str, Any]:
    """Kernel categories of the target forward and of the drafter step, each alone; TTT-step timings."""
    parts = build_parts(compiled=not DRY, attn="sdpa" if DRY else "flex")  # the engine's on CUDA
    torch, dev, target = parts["torch"], parts["dev"], parts["target"]
    from torch.profiler import ProfilerActivity, profile

    from engine.trainer.draft.model import ttt_step
    from engine.trainer.run.producer import DeviceBatch
    from engine.trainer.threads.compile import GuardedFunction, apply_dynamo_config

    apply_dynamo_config()
    draft_ids = parts["vocab"].draft_to_target.to(dev)
    t2d = parts["vocab"].t2d(target.vocab_size).to(dev)
    sync = (lambda: None) if DRY else torch.cuda.synchronize
    activity = ProfilerActivity.CPU if DRY else ProfilerActivity.CUDA
    if not DRY:
        target.compile()
    hb = parts["source"].batch(0)
    ids, mask = hb.input_ids.to(dev), hb.loss_mask.to(dev)
    for _ in range(max(2, warm)):
        out = target.run(ids, mask, draft_ids, t2d)
    sync()
    calls = max(1, min(steps, 5))
    with profile(activities=[activity]) as prof_t:
        for _ in range(calls):
            target.run(ids, mask, draft_ids, t2d)
        sync()
    target_kernels = kernel_times(prof_t, calls)
    f = flops(target.config, parts["dcfg"], SEQ, TTT, BATCH)
    target_mfu = f["target"] / (target_kernels["kernel_ms"] / 1000) / (PEAK_TFLOPS * 1e12)
    if TARGET_ONLY:
        return {
            "mode": f"profile --target-only batch_size={BATCH}" + (" target_fp8=true" if FP8 else ""),
            "target": target_kernels,
            "target_mfu_kernels": target_mfu,
            "attention_impl": target.config._attn_implementation,
            "peak_gib": 0.0 if DRY else torch.cuda.max_memory_allocated() / 2**30,
        }
    timed = TimedStep(GuardedFunction(ttt_step, compiled=not DRY, name="ttt_step"))
    worker = bench_worker(parts, timed)  # a GuardedFunction with CUDA events around each call
    worker.warm_up()
    batch = DeviceBatch(
        0, SEQ, ids, out.hidden3, out.target_logits, out.target_lse, out.position_mask, loss_mask=out.loss_mask
    )
    for _ in range(warm):
        worker.train_step(batch, 0.0)
    sync()
    # TTT-step timings (no profiler): forward per step, backward from each step's gradient to the previous one.
    fwd_ms = [0.0] * TTT
    bwd_ms = [0.0] * TTT
    phase = {"fwd": 0.0, "bwd": 0.0, "opt": 0.0}
    timed.active = True
    for _ in range(calls):
        timed.fwd.clear()
        timed.bwd.clear()
        res, _ = worker.train_step(batch, 0.0)
        sync()
        for k in phase:
            phase[k] += res.ms[k] / calls
        for i, (a, b) in enumerate(timed.fwd):
            fwd_ms[i] += a.elapsed_time(b) / calls
        # The last step's hidden output feeds nothing; marks[j] fires when step TTT-2-j's output has its
        # gradient, i.e. when step TTT-1-j's backward is done: marks[j-1] -> marks[j] is step TTT-1-j's.
        marks = timed.bwd
        for j in range(1, len(marks)):
            bwd_ms[TTT - 1 - j] += marks[j - 1].elapsed_time(marks[j]) / calls
    timed.active = False
    with profile(activities=sorted({ProfilerActivity.CPU, activity}, key=str)) as prof_d:
        for _ in range(calls):
            with torch.profiler.record_function("bench::train_step"):
                worker.train_step(batch, 0.0)
        sync()
    drafter_kernels = kernel_times(prof_d, calls, main_range="bench::train_step")
    return {
        "mode": f"profile batch_size={BATCH}"
        + ("" if CAST_ONCE else " cast_weights_once=false")
        + (f" head_positions={HEAD_POSITIONS}" if HEAD_POSITIONS != "trained" else "")
        + (" target_fp8=true" if FP8 else "")
        + (f" drafter_fp8={DRAFTER_FP8}" if DRAFTER_FP8 != "off" else "")
        + (f" drafter_fp8_mlp={DRAFTER_FP8_MLP}" if DRAFTER_FP8_MLP != "composed" else ""),
        "target": target_kernels,
        "target_mfu_kernels": target_mfu,
        "attention_impl": target.config._attn_implementation,
        "drafter": drafter_kernels,
        "drafter_mfu_kernels": f["drafter"] / (drafter_kernels["kernel_ms"] / 1000) / (PEAK_TFLOPS * 1e12),
        "drafter_phase_ms": phase,
        "trained_share": trained_share(out.position_mask),
        "ttt_forward_ms": [round(v, 2) for v in fwd_ms],
        # Steps 1..TTT-2's backward (layer, head and loss) by the hooks; the last step's and step 0's (with
        # the fc) are the rest of the backward phase.
        "ttt_backward_ms": {str(i): round(bwd_ms[i], 2) for i in range(1, TTT - 1)},
        "backward_first_and_last_ms": round(phase["bwd"] - sum(bwd_ms[1 : TTT - 1]), 2),
        "dry_run_cpu": DRY,
        "peak_gib": 0.0 if DRY else torch.cuda.max_memory_allocated() / 2**30,
    }


def mode_engine(steps: int, warm: int, extra: list[str]) -> dict[str, Any]:
    import torch

    from engine.trainer.config import from_dict, parse_override, preset
    from engine.trainer.run.loop import TrainingRun
    from engine.trainer.threads.metrics import EventLog

    overrides: dict[str, Any] = {
        "steps": warm + steps,
        "log_every": 1,
        "checkpoint_every": 0,
        "resume": False,
        "output_dir": tempfile.mkdtemp(prefix="bench-engine-"),  # removed once read (a --set output_dir is kept)
        "buckets": [SEQ],
        "ttt_steps": TTT,
        "draft_vocab_size": DRAFT_VOCAB,
    }
    if DRY:  # the whole mode's code on the CPU (tiny target, eager): what a device call would run, without one
        overrides.update(
            {
                "target": "tiny",
                "target_devices": ["cpu"],
                "drafter_devices": ["cpu"],
                "compile": False,
                "compile_target": False,
                "attention": "sdpa",
                "cuda_streams": "per_thread",
                "torch_threads": 1,
            }
        )
    own_dir = overrides["output_dir"]
    overrides.update(dict(parse_override(s) for s in extra))
    cfg = from_dict(overrides, preset("h200-single"))
    # The engine's human lines (stage=..., step=...) to stderr: a mode that runs past --timeout-s shows in its record
    # how far it got (the build, the warm-up, which step); stdout keeps the RESULT line alone.
    events = EventLog(None, stdout=sys.stderr)
    got: list[tuple[float, dict[str, Any]]] = []
    events.listeners.append(lambda ev: got.append((time.perf_counter(), ev)))
    t0 = time.perf_counter()
    engine = TrainingRun(cfg, events)
    engine.build()
    built = time.perf_counter()
    code = engine.run()
    record = Path(cfg.output_dir) / "ranks" / "rank0.json"
    digests = json.loads(record.read_text())["weights_sha256"] if record.exists() else {}
    shutil.rmtree(own_dir, ignore_errors=True)
    steps_ev = [(t, e) for t, e in got if e["kind"] == "step"]
    training = [t for t, e in got if e["kind"] == "stage" and e["stage"] == "training"]
    first_step = steps_ev[0][0] if steps_ev else float("nan")
    tail = [t for t, e in steps_ev if e["step"] > warm]
    n_workers = len(cfg.drafter_devices)
    gpus = {d for d in cfg.drafter_devices + cfg.target_devices if d.startswith("cuda")} or {"cuda:0"}
    tokens_per_step = SEQ * cfg.batch_size
    if len(tail) >= 2:
        span = tail[-1] - tail[0]
        tok_s = tokens_per_step * (len(tail) - 1) / span
    else:
        tok_s = float("nan")
    f = flops(engine.targets[0].config, engine.workers[0].training.drafter.cfg, SEQ, TTT, cfg.batch_size)
    share = None
    if engine.source is not None and engine.vocab is not None:  # the share of positions batch 0 trains per TTT step
        target, hb = engine.targets[0], engine.source.batch(0)
        with torch.no_grad():
            first = target.run(
                hb.input_ids.to(target.device),
                hb.loss_mask.to(target.device),
                engine.vocab.draft_to_target.to(target.device),
                engine.vocab.t2d(target.vocab_size).to(target.device),
            )
        share = trained_share(first.position_mask)
    ms = [e["ms"] for t, e in steps_ev if e["step"] > warm]
    tms = [e["target_ms"] for t, e in steps_ev if e["step"] > warm]
    return {
        "mode": "engine " + " ".join(extra),
        "exit_code": code,
        "tok_s": tok_s,
        "tok_s_all_threads": tok_s if cfg.drafter_mode == "replicas" else tok_s * n_workers,
        "step_ms": 1000 * tokens_per_step / tok_s if tok_s == tok_s else None,
        "gpus": len(gpus),
        "mfu_per_gpu": (f["target"] + f["drafter"]) * tok_s / tokens_per_step / len(gpus) / (PEAK_TFLOPS * 1e12),
        "phase_ms": {k: sum(m[k] for m in ms) / max(1, len(ms)) for k in ("fetch", "fwd", "bwd", "opt")},
        "producer_target_ms": sum(tms) / max(1, len(tms)),
        "head_positions": cfg.head_positions,
        "trained_share": share,
        "build_s": built - t0,
        "warmup_s": (training[0] - built) if training else None,
        "start_to_first_step_s": first_step - t0,
        "warmup_per_thread_s": [w.warmup_s for w in engine.workers],
        "peak_gib": 0.0 if DRY else torch.cuda.max_memory_allocated() / 2**30,
        "steps_seen": len(steps_ev),
        "output_dir": cfg.output_dir,  # gone by now unless a --set named it
        # Replicas on several GPUs: equal weight digests on every GPU at the end (checked, not assumed).
        "weights_equal_across_gpus": len(set(digests.values())) == 1 if digests else None,
        "compile_events": [e for _t, e in got if e["kind"] == "compile"],  # recompiles after warm-up, fallbacks
        "failures": [e for _t, e in got if e["kind"] in ("thread_error", "run_end") and not e.get("ok", False)],
    }


def mode_ranks(steps: int, warm: int, extra: list[str], nproc: int, timeout_s: float) -> dict[str, Any]:
    """The engine as ``nproc`` torchrun ranks of one node (h200-single per rank: rank L on cuda:L)."""
    out = Path(tempfile.mkdtemp(prefix="bench-ranks-"))  # removed once read
    sets = [
        f"steps={warm + steps}",
        "log_every=1",
        "checkpoint_every=0",
        "resume=false",
        f"buckets=[{SEQ}]",
        f"ttt_steps={TTT}",
        f"draft_vocab_size={DRAFT_VOCAB}",
        *extra,
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    cmd += ["-m", "engine.trainer", "--preset", "h200-single", "--output-dir", str(out)]
    for item in sets:
        cmd += ["--set", item]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPECDEC_EVENTS", None)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=REPO, env=env)
    wall = time.perf_counter() - t0
    batch = next((int(x.split("=", 1)[1]) for x in extra if x.startswith("batch_size=")), BATCH)
    per_rank: dict[int, float] = {}
    first_step_s: dict[int, float] = {}
    for path in sorted(out.glob("events*.jsonl")):
        evs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        rank = next((e["rank"] for e in evs if "rank" in e), 0)
        ts = [e["t"] for e in evs if e["kind"] == "step" and e["step"] > warm]
        start = next((e["t"] for e in evs if e["kind"] == "stage" and e.get("stage") == "imports"), None)
        first = next((e["t"] for e in evs if e["kind"] == "step"), None)
        if start is not None and first is not None:
            first_step_s[rank] = first - start
        if len(ts) >= 2:
            per_rank[rank] = SEQ * batch * (len(ts) - 1) / (ts[-1] - ts[0])
    records = {int(f.stem[4:]): json.loads(f.read_text()) for f in sorted((out / "ranks").glob("rank*.json"))}
    digests = {d for r in records.values() for d in r["weights_sha256"].values()}
    tok_s = sum(per_rank.values()) if per_rank else float("nan")
    shutil.rmtree(out, ignore_errors=True)
    return {
        "mode": f"ranks nproc={nproc} " + " ".join(extra),
        "exit_code": p.returncode,
        "tok_s": tok_s,
        "tok_s_per_rank": per_rank,
        "start_to_first_step_s": first_step_s,
        "weights_equal_across_ranks": len(digests) == 1 if records else None,
        "ranks_recorded": sorted(records),
        "run_s": wall,
        "output_tail": (p.stdout + p.stderr)[-3000:] if p.returncode else "",
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["all", "baseline", "sides", "engine", "ranks", "profile"])
    ap.add_argument("--nproc", type=int, default=2, help="ranks: torchrun ranks on this node (one GPU each)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--compile-target", action="store_true")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/bench"))
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--plan", default="baseline;sides;engine")
    ap.add_argument("--batch", type=int, default=1, help="batch size of every mode (the engine: --set batch_size)")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="baseline, profile, engine: the code path on the CPU (tiny target, seq 128)",
    )
    ap.add_argument("--target-only", action="store_true", help="profile: the target forward alone")
    a = ap.parse_args()
    global BATCH, CAST_ONCE, DRAFTER_FP8, DRAFTER_FP8_MLP, DRY, FP8, HEAD_POSITIONS, SEQ, DRAFT_VOCAB, TARGET_ONLY
    BATCH = a.batch
    CAST_ONCE = "cast_weights_once=false" not in a.set
    FP8 = "target_fp8=true" in a.set
    from engine.trainer.config import parse_override  # stdlib only

    DRAFTER_FP8 = next((str(v) for k, v in map(parse_override, a.set) if k == "drafter_fp8"), DRAFTER_FP8)
    DRAFTER_FP8_MLP = next((str(v) for k, v in map(parse_override, a.set) if k == "drafter_fp8_mlp"), DRAFTER_FP8_MLP)
    HEAD_POSITIONS = next((str(v) for k, v in map(parse_override, a.set) if k == "head_positions"), HEAD_POSITIONS)
    if FP8 and a.dry_run:
        print("bench_engine.py: --set target_fp8=true needs an FP8 GPU; the dry run has none", file=sys.stderr)
        return 2
    TARGET_ONLY = a.target_only
    if a.dry_run:
        DRY, SEQ, DRAFT_VOCAB = True, 128, 256
    if not any(s.startswith("batch_size=") for s in a.set):
        a.set.append(f"batch_size={a.batch}")
    if a.mode != "all":
        if a.mode == "baseline":
            res = mode_baseline(a.steps, a.warm)
        elif a.mode == "sides":
            res = mode_sides(a.steps, a.warm, a.compile_target)
        elif a.mode == "profile":
            res = mode_profile(a.steps, a.warm)
        elif a.mode == "ranks":
            res = mode_ranks(a.steps, a.warm, a.set, a.nproc, a.timeout_s)
        else:
            res = mode_engine(a.steps, a.warm, a.set)
        print("RESULT " + json.dumps(res))
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for item in a.plan.split(";"):
        argv = item.split()
        cmd = [sys.executable, __file__, *argv, "--steps", str(a.steps), "--warm", str(a.warm), "--batch", str(a.batch)]
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s, cwd=REPO)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {"mode": item, "error": p.stderr[-3000:]}
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
            res = {"mode": item, "error": f"timeout after {a.timeout_s} s", "stderr": err[-2000:]}
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        results.append(res)
        print(json.dumps(res, indent=1, default=str), flush=True)
    (out / "bench_engine.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
