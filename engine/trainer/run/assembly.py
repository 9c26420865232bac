"""The engine's parts, each made by one small factory: devices, targets, data, drafters with their optimizers, the
workers' shared step, producers and streams.

``run.loop.TrainingRun.build`` calls them in order and keeps what they return; each can be called (and tested) alone.
The factories that depend on the torchrun world (barriers, broadcasts) stay on the engine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.protocol import StageEvent
from engine.trainer.config import (
    BUILTIN_TARGETS,
    DATA_RANDOM,
    DATA_SHIPPED,
    DRAFTER_FP8_OFF,
    ConfigError,
    TrainerConfig,
    fused_mlp_runs,
)
from engine.trainer.data.dispatch import Dispatcher, IndexLedger
from engine.trainer.data.sources import BatchSource, ConversationSource, RandomTokenSource, shipped_corpus_path
from engine.trainer.data.vocab import DraftVocab
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.fp8 import cpu_rowwise_supported, misaligned, weight_layouts
from engine.trainer.draft.fp8_mlp import register_cuda_kernels
from engine.trainer.draft.loss import needs_full_vocab_lse
from engine.trainer.draft.model import DraftConfig, Drafter, ttt_step
from engine.trainer.run.distributed import map_devices
from engine.trainer.run.fp8_check import keeps_exact_weights
from engine.trainer.run.producer import Producer, Route
from engine.trainer.run.torchrun import RankInfo
from engine.trainer.run.worker import DrafterTraining, DrafterWorker
from engine.trainer.threads.compile import GuardedFunction, set_guard_enabled
from engine.trainer.threads.control import ThreadControl
from engine.trainer.threads.metrics import EventLog
from engine.trainer.verifier.fp8 import fp8_unsupported_reason
from engine.trainer.verifier.model import FrozenTarget, load_target
from engine.trainer.verifier.packed import packing_refusal_for, text_config

# Added to a drafter's seed for its initial weights, so they do not repeat the target's (seeded with the seed).
DRAFTER_SEED_OFFSET = 7919


def lr_lambda(cfg: TrainerConfig) -> Callable[[int], float]:
    """The learning-rate factor per step: linear warm-up (cfg.warmup steps), then constant, linear or cosine decay
    to cfg.steps."""
    warmup = cfg.warmup

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, cfg.steps - warmup)
        frac = min(1.0, (step - warmup) / span)
        if cfg.schedule == "linear":
            return max(0.0, 1.0 - frac)
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    return fn


def dtypes_for(cfg: TrainerConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
    """(target dtype, autocast dtype) for a device."""
    if cfg.dtype == "float32":
        return torch.float32, None
    if device.type == "cuda" or cfg.dtype == "bfloat16":
        return torch.bfloat16, torch.bfloat16
    return torch.float32, None


def configure_torch(cfg: TrainerConfig, events: EventLog) -> None:
    """The process-wide torch settings of a run: intra-op threads and the compile guard."""
    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    set_guard_enabled(cfg.compile_guard)
    if not cfg.compile_guard:
        events.say("warning: compile guard DISABLED (control experiment): threads may compile concurrently")


def devices_for(cfg: TrainerConfig, info: RankInfo) -> tuple[list[torch.device], list[torch.device]]:
    """This rank's (target devices, drafter devices); raises when one names a GPU this node lacks."""
    tdevs = [torch.device(d) for d in map_devices(cfg.target_devices, info)]
    ddevs = [torch.device(d) for d in map_devices(cfg.drafter_devices, info)]
    cuda = [d for d in tdevs + ddevs if d.type == "cuda"]
    if cuda and not torch.cuda.is_available():
        key = "target_devices" if any(d.type == "cuda" for d in tdevs) else "drafter_devices"
        raise ConfigError(
            f"{key}: names {cuda[0]}, but torch {torch.__version__} sees no CUDA device here "
            '(a CPU-only build, or no driver); use ["cpu"] or a CUDA build of torch'
        )
    for key, devs in (("target_devices", tdevs), ("drafter_devices", ddevs)):
        for d in devs:
            if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
                raise ConfigError(
                    f"{key}: rank {info.rank} (local rank {info.local_rank}) maps to {d}, but this node has "
                    f"{torch.cuda.device_count()} GPU(s): lower nproc_per_node or name fewer devices per rank"
                )
    return tdevs, ddevs


# Measured by tests/bench/bench_kernels.py --parts unroll (8B drafter, bf16; flex and SDPA 2-3 % off float32 there).
MERGED_ON_CUDA = (
    "attention: 'merged' gives wrong gradients on CUDA (q/k/v, fc and norm gradients 120-190 % off float32 "
    "through cuDNN's backward, measured on an H200): use 'flex' (the default there)"
)


def attention_impl(cfg: TrainerConfig, ddevs: list[torch.device]) -> str:
    """The drafters' attention kernel: the configured one, or for "auto" flex on CUDA and sdpa on the CPU."""
    impl = cfg.attention if cfg.attention != "auto" else ("flex" if ddevs[0].type == "cuda" else "sdpa")
    if impl == "flex" and any(d.type == "cpu" for d in ddevs):
        raise ConfigError("attention: 'flex' needs CUDA drafters (flex_attention has no CPU backward); use 'sdpa'")
    if impl == "merged" and any(d.type == "cuda" for d in ddevs):
        raise ConfigError(MERGED_ON_CUDA)
    return impl


def check_drafter_fp8(cfg: TrainerConfig, ddevs: list[torch.device]) -> None:
    """drafter_fp8 needs row-wise scaled FP8 matmuls on every drafter device (CUDA 9.0+, or the CPU where torch's
    ``_scaled_mm`` takes row-wise scales): a ConfigError naming the first device without them."""
    if cfg.drafter_fp8 == DRAFTER_FP8_OFF:
        return
    for dev in ddevs:
        if dev.type == "cpu" and not cpu_rowwise_supported():
            raise ConfigError(
                f"drafter_fp8: torch {torch.__version__}'s CPU _scaled_mm takes no row-wise scales (2.13 does); "
                "use a CUDA drafter or drafter_fp8 = 'off'"
            )
        reason = fp8_unsupported_reason(dev, key="drafter_fp8")
        if reason is not None:
            raise ConfigError(reason)
    if fused_mlp_runs(cfg.drafter_fp8, cfg.drafter_fp8_mlp) and any(d.type == "cuda" for d in ddevs):
        try:
            register_cuda_kernels()  # the fused MLP's Triton kernels: here, before a thread starts, or a clear refusal
        except ImportError as exc:
            said = (str(exc).splitlines() or [type(exc).__name__])[0]  # one line, whatever the import said
            raise ConfigError(
                f"drafter_fp8_mlp = 'fused' needs Triton on CUDA, which does not import here ({said}); "
                "use drafter_fp8_mlp = 'composed'"
            ) from None
    path = Path(cfg.target).expanduser()
    if cfg.target in BUILTIN_TARGETS or not (path / "config.json").is_file():
        return  # a built-in is built, not read: the check after the drafters are built is its only one
    # A target directory: its sizes are known before its weights load. A config this cannot read here (custom code,
    # sizes under other names) is left to that same later check, as before.
    try:
        from transformers import AutoConfig

        text = text_config(AutoConfig.from_pretrained(str(path)))
        draft_size = min(cfg.draft_vocab_size, int(text.vocab_size))  # as the draft vocabulary is built
        shapes = DraftConfig.from_target(text, draft_size).linear_shapes()
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return
    refuse_misaligned(shapes)


def refuse_misaligned(shapes: dict[str, tuple[int, int]]) -> None:
    """drafter_fp8's ConfigError when a drafter Linear's sizes are not multiples of 16 (``shapes``: (out, in))."""
    refusal = misaligned(shapes)
    if refusal is not None:
        raise ConfigError(
            f"drafter_fp8: FP8 matmuls need every Linear's sizes in multiples of 16; {refusal} (from the "
            "target's hidden and intermediate sizes and draft_vocab_size); use drafter_fp8 = 'off'"
        )


FP8_NOTE = " (FP8 linears)"  # the target_loaded stage names an FP8 target


def load_targets(
    cfg: TrainerConfig,
    devices: list[torch.device],
    tokenizer: Any,
    on_compile: Callable[..., None],
    events: EventLog,
) -> list[FrozenTarget]:
    """One target per target device (compiled when asked, on CUDA), each reported as ``target_loaded``. A target
    that packed rows cannot keep exact is refused before its weights load (a ConfigError: exit 2, one line)."""
    if cfg.packing:
        refusal = packing_refusal_for(cfg.target, cfg.buckets[-1])
        if refusal is not None:
            raise ConfigError(refusal)
    targets = []
    for i, dev in enumerate(devices):
        t0 = time.perf_counter()
        tdtype, _ = dtypes_for(cfg, dev)
        target = load_target(
            cfg.target,
            dev,
            tokenizer=tokenizer,
            layer_ids=cfg.target_layers,
            seed=cfg.seed,
            dtype=tdtype,
            tiny_hidden=cfg.tiny_hidden,
            tiny_layers=cfg.tiny_layers,
            fp8=cfg.target_fp8,
            keep_exact=keeps_exact_weights(cfg),
        )
        target.full_vocab_lse = needs_full_vocab_lse(cfg.loss)  # an LK loss's acceptance (draft/loss.py)
        if cfg.compile and cfg.compile_target and dev.type == "cuda":
            target.compile()
        for fn in target.compiled_functions():
            fn.listeners.append(on_compile)
        targets.append(target)
        events.stage(
            "target_loaded",
            f"target{i} {cfg.target} on {dev}{FP8_NOTE if cfg.target_fp8 else ''} layers {target.layer_ids} "
            f"in {time.perf_counter() - t0:.1f} s",
        )
    return targets


def data_source(
    cfg: TrainerConfig,
    tokenizer: Any,
    target_vocab_size: int,
    output_dir: Path,
    events: EventLog,
    should_stop: Callable[[], str | None] | None = None,
) -> BatchSource:
    """The training batches: random token ids, or the configured conversations tokenized (through the cache).
    ``should_stop`` (a stop signal's name, or None) ends the reading and tokenizing early: LoadingStopped."""
    if cfg.data == DATA_RANDOM or tokenizer is None:
        if cfg.packing:
            raise ConfigError(f"packing: needs conversations; target {cfg.target!r} has no tokenizer (random tokens)")
        return RandomTokenSource(target_vocab_size, buckets=cfg.buckets, batch_size=cfg.batch_size, seed=cfg.seed)
    path = shipped_corpus_path() if cfg.data == DATA_SHIPPED else Path(cfg.data).expanduser()
    cache_dir = Path(cfg.data_cache_dir).expanduser() if cfg.data_cache_dir else output_dir / "data_cache"
    source = ConversationSource(
        tokenizer,
        path,
        buckets=cfg.buckets,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        eval_holdout=cfg.eval_holdout,
        cache_dir=cache_dir,
        progress=lambda text: events.stage("data", text),
        strict=cfg.strict_data,
        packing=cfg.packing,
        should_stop=should_stop,
    )
    report_data(source, events)
    return source


def report_data(source: ConversationSource, events: EventLog) -> None:
    """Every conversation not trained on is counted, with its reason: an event and a log line."""
    skipped = dict(sorted(source.skipped.items()))
    total = sum(skipped.values())
    detail = (
        f"{source.examples} conversations to train on, {len(source.heldout_indices)} held out, "
        f"{total} skipped"
        + (f" ({', '.join(f'{k}: {v}' for k, v in skipped.items())})" if total else "")
        + (f", {source.corpus.truncated} cut to {source.buckets[-1]} tokens" if source.corpus.truncated else "")
        + (f"; malformed lines: {'; '.join(source.bad_lines)}" if source.bad_lines else "")
    )
    events.emit(
        StageEvent(
            stage="data",
            detail=detail,
            skipped=skipped,
            heldout=len(source.heldout_indices),
            truncated=source.corpus.truncated,
            bad_lines=source.bad_lines,
            cached=source.cache_hit,
        )
    )
    events.say(f"stage=data {detail}")


def model_ledgers(mode: str, drafters: int) -> list[IndexLedger]:
    """The trained batch indices per drafter: replicas train one model (one ledger), independent drafters one each."""
    if mode == "replicas":
        return [IndexLedger()] * drafters
    return [IndexLedger() for _ in range(drafters)]


def shared_step(
    cfg: TrainerConfig, ddevs: list[torch.device], impl: str, on_compile: Callable[..., None]
) -> tuple[TTTAttention, GuardedFunction]:
    """The attention and TTT step all workers share: compiled once (under the guard) on CUDA, then reused."""
    compiled = cfg.compile and ddevs[0].type == "cuda"
    attention = TTTAttention(impl, compiled=compiled, flex_bwd_num_stages=cfg.flex_bwd_num_stages)
    step_fn = GuardedFunction(ttt_step, compiled=compiled, name="ttt_step")
    for fn in [step_fn, *attention.compiled_functions()]:
        fn.listeners.append(on_compile)
    return attention, step_fn


def fp8_layouts(
    cfg: TrainerConfig, ddevs: list[torch.device], on_compile: Callable[..., None]
) -> GuardedFunction | None:
    """drafter_fp8: the weights' quantisation once a step (fp8.weight_layouts), compiled on CUDA like the TTT step
    and shared by the workers: one graph for all the weights instead of a dozen eager passes over each (on one H100
    at the 8B shape, batch 4, the drafter's kernels went from 201.3 to 193.5 ms a step). None when drafter_fp8 is
    off."""
    if cfg.drafter_fp8 == DRAFTER_FP8_OFF:
        return None
    fn = GuardedFunction(weight_layouts, compiled=cfg.compile and ddevs[0].type == "cuda", name="fp8_weights")
    fn.listeners.append(on_compile)
    return fn


def build_drafters(
    cfg: TrainerConfig, dcfg: DraftConfig, ddevs: list[torch.device], targets: list[FrozenTarget], vocab: DraftVocab
) -> list[Drafter]:
    """One drafter per drafter device, its embedding the target's on that device (else a copy of the first
    target's); replicas start from the same weights, independent drafters each from their own seed."""
    if cfg.drafter_fp8 != DRAFTER_FP8_OFF:  # a built-in target (no config.json to read before) is checked here
        refuse_misaligned(dcfg.linear_shapes())
    replicas = cfg.drafter_mode == "replicas"
    drafters: list[Drafter] = []
    for rank, dev in enumerate(ddevs):
        embed = next((t.embed_weight() for t in targets if t.device == dev), None)
        if embed is None:
            embed = targets[0].embed_weight().to(dev)
        seed = cfg.seed if replicas else cfg.seed + rank
        with torch.random.fork_rng(devices=[]), torch.device(dev):
            torch.manual_seed(seed + DRAFTER_SEED_OFFSET)
            drafter = Drafter(dcfg, embed, vocab.draft_to_target.to(dev), ttt_rope_offset=cfg.ttt_rope_offset)
        if replicas and drafters:
            drafter.load_state_dict(drafters[0].state_dict())
        drafters.append(drafter)
    return drafters


def gradient_shapes(cfg: TrainerConfig, drafters: list[Drafter]) -> list[list[torch.Size]]:
    """The trainable parameters' shapes per model (replicas: one model), in the order they are exchanged."""
    models = drafters[:1] if cfg.drafter_mode == "replicas" else drafters
    return [[p.shape for p in d.trainable_parameters()] for d in models]


def build_optimizer(
    cfg: TrainerConfig, drafter: Drafter, rank: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over the drafter's trainable parameters (drafter_lrs: one rate per drafter) and its LR schedule.

    Fused on every device: one kernel a step, which also clips the gradients and skips a non-finite step without
    a host check (worker.clipped_step)."""
    optimizer = torch.optim.AdamW(
        drafter.trainable_parameters(),
        lr=float(cfg.drafter_lrs[rank]) if cfg.drafter_lrs else cfg.lr,
        betas=(cfg.adam_betas[0], cfg.adam_betas[1]),
        weight_decay=cfg.weight_decay,
        fused=True,
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))


def drafter_training(
    cfg: TrainerConfig,
    drafter: Drafter,
    rank: int,
    device: torch.device,
    attention: TTTAttention,
    step_fn: GuardedFunction,
    layouts_fn: GuardedFunction | None = None,
) -> DrafterTraining:
    """A worker's model with its optimizer and schedule, and the dtypes of its device (``layouts_fn``:
    ``fp8_layouts``'s, shared by the workers)."""
    optimizer, scheduler = build_optimizer(cfg, drafter, rank)
    hidden_dtype, autocast_dtype = dtypes_for(cfg, device)
    return DrafterTraining(
        drafter, device, optimizer, scheduler, attention, step_fn, hidden_dtype, autocast_dtype, layouts_fn
    )


def start_batches(trained: int, n_targets: int, producer: int) -> int:
    """The batches producer ``producer`` of ``n_targets`` would have made so far had the run not stopped."""
    return trained // n_targets + (1 if producer < trained % n_targets else 0)


def build_producers(
    targets: list[FrozenTarget],
    source: BatchSource,
    routes: list[Route],
    dispatcher: Dispatcher,
    vocab: DraftVocab,
    control: ThreadControl,
    trained: int,
    rows_ttt_steps: int = 0,
) -> list[Producer]:
    """One producer thread per target, feeding every drafter's route through the shared dispatcher
    (``rows_ttt_steps``: the TTT steps each batch's trained rows are made for, 0 for none; Producer)."""
    return [
        Producer(
            f"target{p}",
            target,
            source,
            routes,
            dispatcher,
            start_batches=start_batches(trained, len(targets), p),
            draft_ids=vocab.draft_to_target,
            t2d=vocab.t2d(target.vocab_size),
            control=control,
            rows_ttt_steps=rows_ttt_steps,
        )
        for p, target in enumerate(targets)
    ]


def share_streams(producers: list[Producer], workers: list[DrafterWorker]) -> None:
    """cuda_streams = "per_device": the threads on one GPU share one stream (kernels queue in order)."""
    streams: dict[str, Any] = {}
    for thread_dev, obj in [(p.target.device, p) for p in producers] + [(w.training.device, w) for w in workers]:
        if thread_dev.type == "cuda":
            obj.stream = streams.setdefault(str(thread_dev), torch.cuda.Stream(thread_dev))
