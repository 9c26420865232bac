"""Drafter workers: one thread per drafter device, training an EAGLE-3 drafter on the producers' batches.

``replicas`` mode: the workers train one drafter data-parallel; after each backward they meet in a
``ReplicaGroup`` that averages the gradients (``torch.cuda.comm`` across distinct GPUs, a plain average on
the CPU or when replicas share a device), records the step's batch indices as trained in the shared ledger and
agrees on whether to stop after this step.
``independent`` mode: each worker trains its own drafter on every batch (a sweep).
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.protocol import NonFiniteGradEvent, StepEvent
from engine.trainer.checkpoint import rng_state, set_rng_state, to_cpu
from engine.trainer.config import DRAFTER_FP8_MLP_COMPOSED, DRAFTER_FP8_OFF, HEAD_POSITIONS_TRAINED, TrainerConfig
from engine.trainer.data.dispatch import IndexLedger
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.average import EMA_KEY, WeightAverage
from engine.trainer.draft.loss import accuracies, loss_function, soft_cross_entropy, total_loss, weighted_total
from engine.trainer.draft.model import Drafter
from engine.trainer.draft.rows import TrainedRows, trained_rows
from engine.trainer.run.distributed import CrossRank
from engine.trainer.run.producer import DeviceBatch
from engine.trainer.threads.compile import GuardedFunction, apply_dynamo_config, compile_guard, lending_guard
from engine.trainer.threads.control import NonFiniteGradient, NonFiniteLoss, PeerFailure, ThreadControl
from engine.trainer.threads.health import name_os_thread
from engine.trainer.threads.metrics import step_line
from engine.trainer.threads.queue import BoundedQueue, ProducerFailed, QueueClosed, QueueTimeout

GET_POLL_S = 0.25
# Warm-up trains every bucket with each row's first quarter untrained (a prompt), then, where the compiled steps take
# a row count, with its first three quarters untrained. One graph a step for every count is the aim (draft/rows.py),
# but a graph traced at one count can carry a guard that counts on the other side of some size fail; warming up on
# both sides makes that second graph in warm-up, not at the first real batch. On one H100 at the 8B shape, batch 8
# (counts about 12,280 in warm-up, 4,230 in real batches) compiled every TTT step again at the first real batch;
# batch 4 (6,100 and 2,100) compiled nothing again, and a warm-up count of 8,200 at batch 4 did.
WARMUP_PROMPT_SHARES = (0.25, 0.75)


WAIT_SLICE_S = 0.5  # a member waiting at the barrier wakes this often (abort checks, liveness beats)


class ReplicaGroup:
    """A barrier that averages gradients across replicas; survives a replica leaving (policy ``continue``).

    ``replicas`` mode: the members train one model; their gradients are summed on the first member's device and
    divided by the number of contributing replicas (in this process, or in the world when ``cross`` is given).
    ``independent`` mode (only with ``cross``): each member is its own model, averaged with the same member
    on the other ranks. The thread that completes the barrier runs the cross-rank collective: one thread per
    rank per round, rounds in the same order on every rank.
    """

    def __init__(
        self,
        ranks: list[int],
        devices: list[torch.device],
        should_stop: Callable[[], bool],
        ledger: IndexLedger | None = None,
        *,
        mode: str = "replicas",
        ledgers: dict[int, IndexLedger] | None = None,
        cross: CrossRank | None = None,
        shapes: list[list[torch.Size]] | None = None,
        after_round: Callable[[int, bool], None] | None = None,
        failing: Callable[[], bool] = lambda: False,
        on_wait: Callable[[int], None] | None = None,
    ) -> None:
        if ledgers is None:
            ledgers = {r: ledger for r in ranks} if ledger is not None else {}
        self._ledgers = ledgers
        self._members = list(ranks)
        self._mode = mode
        self._cross = cross
        self._shapes = shapes if shapes is not None else []  # the engine fills it as it builds the drafters
        self._after_round = after_round
        self._failing = failing  # this process is aborting: peers must fail, not stop gracefully
        # Called every WAIT_SLICE_S while a member waits for its peers (e.g. one evaluating): it is alive, not hung.
        self._on_wait = on_wait
        self._indices: dict[int, int] = {}
        self._live = set(ranks)
        self._devices = dict(zip(ranks, devices, strict=True))
        self._should_stop = should_stop
        self._cond = threading.Condition()
        self._slots: dict[int, list[torch.Tensor]] = {}
        self._steps: dict[int, int] = {}
        self._generation = 0
        self._stop_decision = False
        self._error: BaseException | None = None

    @property
    def live(self) -> list[int]:
        with self._cond:
            return sorted(self._live)

    @property
    def mode(self) -> str:
        return self._mode

    @property
    def crosses_ranks(self) -> bool:
        return self._cross is not None

    def leave(self, rank: int) -> None:
        with self._cond:
            self._live.discard(rank)
            self._slots.pop(rank, None)
            self._indices.pop(rank, None)
            self._steps.pop(rank, None)
            if self._error is None and self._live and set(self._slots) >= self._live:
                self._complete()

    def abort(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def _raise_aborted(self) -> None:
        err = self._error
        if isinstance(err, PeerFailure):
            raise PeerFailure(str(err)) from err  # every thread of the rank names the peer
        raise RuntimeError(f"replica group aborted: {type(err).__name__}: {err}") from err

    def all_reduce(self, rank: int, grads: list[torch.Tensor], index: int = -1, step: int = 0) -> bool:
        """Average ``grads`` in place across live replicas and record every replica's batch ``index`` as trained
        (all at once, so a checkpoint taken after this step holds all of them); returns whether every replica
        stops after this step (in a torchrun world: every rank)."""
        if self._devices[rank].type == "cuda":
            torch.cuda.current_stream().synchronize()  # this replica's grads are complete
        with self._cond:
            if self._error is not None:
                self._raise_aborted()
            gen = self._generation
            self._slots[rank] = grads
            self._indices[rank] = index
            self._steps[rank] = step
            if set(self._slots) >= self._live:
                self._complete()
            else:
                while self._generation == gen and self._error is None:
                    self._cond.wait(WAIT_SLICE_S)
                    if self._on_wait is not None and self._generation == gen:
                        self._on_wait(rank)
                if self._error is not None and self._generation == gen:
                    self._raise_aborted()
            return self._stop_decision

    def _complete(self) -> None:
        ranks = sorted(self._slots)
        step = max(self._steps.values(), default=0)
        try:
            stop = self._should_stop()
            if self._mode == "replicas":
                stop = self._reduce_replicas(ranks, stop, step)
            elif self._cross is not None:
                models = [self._slots.get(m) for m in self._members]
                counts = [1 if m in self._slots else 0 for m in self._members]
                totals, stop = self._cross.all_reduce(models, self._shapes, counts, stop, step, self._failing())
                for grads, total in zip(models, totals, strict=True):
                    if grads is not None and total > 1:
                        torch._foreach_div_(grads, float(total))
            for r in ranks:
                if self._indices.get(r, -1) >= 0 and r in self._ledgers:
                    self._ledgers[r].mark(self._indices[r])
            if self._after_round is not None:
                self._after_round(step, stop)
        except BaseException as exc:
            self._error = exc
            self._cond.notify_all()
            raise
        self._stop_decision = stop
        self._slots.clear()
        self._indices.clear()
        self._steps.clear()
        self._generation += 1
        self._cond.notify_all()

    def _reduce_replicas(self, ranks: list[int], stop: bool, step: int) -> bool:
        grads = [self._slots[r] for r in ranks]
        devices = [self._devices[r] for r in ranks]
        if self._cross is None:
            if len(ranks) > 1:
                average_gradients(grads, devices)
            return stop
        total = sum_gradients(grads, devices)
        (count,), stop = self._cross.all_reduce([total], self._shapes, [len(ranks)], stop, step, self._failing())
        if count > 1:
            torch._foreach_div_(total, float(count))
        set_gradients(total, grads, devices)
        return stop


def _distinct_cuda(devices: list[torch.device]) -> bool:
    return all(d.type == "cuda" for d in devices) and len({str(d) for d in devices}) == len(devices)


def sum_gradients(grads: list[list[torch.Tensor]], devices: list[torch.device]) -> list[torch.Tensor]:
    """The members' gradients summed on the first member's device (the first member's own tensors for one)."""
    if len(grads) == 1:
        return grads[0]
    if _distinct_cuda(devices):
        from torch.cuda import comm

        return list(comm.reduce_add_coalesced(grads, destination=devices[0].index))
    total = [g.to(grads[0][0].device, copy=True) for g in grads[0]]
    for other in grads[1:]:
        torch._foreach_add_(total, [g.to(total[0].device) for g in other])
    return total


def set_gradients(total: list[torch.Tensor], grads: list[list[torch.Tensor]], devices: list[torch.device]) -> None:
    """Copy ``total`` into every member's gradients."""
    if len(grads) > 1 and _distinct_cuda(devices):
        from torch.cuda import comm

        copies = comm.broadcast_coalesced(total, [d.index for d in devices])
        for rank_grads, rank_copy in zip(grads, copies, strict=True):
            torch._foreach_copy_(rank_grads, list(rank_copy))
    else:
        for rank_grads in grads:
            if rank_grads is not total:
                torch._foreach_copy_(rank_grads, [t.to(rank_grads[0].device) for t in total])
    for d in {str(d): d for d in devices}.values():
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def average_gradients(grads: list[list[torch.Tensor]], devices: list[torch.device]) -> None:
    total = sum_gradients(grads, devices)
    torch._foreach_div_(total, float(len(grads)))
    set_gradients(total, grads, devices)


CLIP_EPS = 1e-6  # clip_grad_norm_'s: the clip factor is max_norm / (norm + CLIP_EPS)


def clipped_step(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """The optimizer's step on the gradients clipped to ``max_norm`` (as ``clip_grad_norm_`` clips), none when their
    norm is not finite; returns that norm (before clipping).

    A fused optimizer does both in its kernel with no host sync: the clip as its ``grad_scale`` (it divides each
    gradient by ``(norm + eps) / max_norm`` when that exceeds 1) and the skip as its ``found_inf`` (weights, moments
    and step count stay as they were), the way GradScaler hands them over. Others: clip in place, then a host check.
    """
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))) if grads else torch.zeros(())
    if optimizer.defaults.get("fused"):
        scaled: Any = optimizer  # the attributes GradScaler sets for a fused step
        scaled.grad_scale = torch.clamp((norm + CLIP_EPS) / max_norm, min=1.0)
        scaled.found_inf = (~torch.isfinite(norm)).to(torch.float32)
        try:
            optimizer.step()
        finally:
            del scaled.grad_scale, scaled.found_inf
    else:
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0))
        if bool(torch.isfinite(norm)):
            optimizer.step()
    return norm


class LaunchedStep:
    """A batch whose forward is launched: its per-TTT-position tensors and the step's timing marks so far."""

    def __init__(self, batch: DeviceBatch, fetch_ms: float, cuda: bool) -> None:
        self.batch = batch
        self.fetch_ms = fetch_ms
        self.cuda = cuda
        self.marks: list[Any] = []  # CUDA events (or host clocks on the CPU): forward, backward, optimizer
        self.losses: torch.Tensor | None = None
        self.correct: torch.Tensor | None = None
        self.counts: torch.Tensor | None = None

    def mark(self) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())


class PendingStep:
    """A finished step whose numbers (losses, accuracies, gradient norm) are on their way to the host."""

    def __init__(self, launched: LaunchedStep, values: torch.Tensor) -> None:
        self.launched = launched
        self._values = values.to("cpu", non_blocking=True) if launched.cuda else values
        self._copied = torch.cuda.Event() if launched.cuda else None
        if self._copied is not None:
            self._copied.record()

    def values(self) -> list[float]:
        if self._copied is not None:
            self._copied.synchronize()
        return [float(v) for v in self._values.tolist()]


@dataclass
class StepResult:
    step: int
    loss: list[float]
    acc: list[float]
    grad_norm: float
    tok_s: float
    ms: dict[str, float]
    skipped: bool = False  # non-finite gradients: the optimizer did not step
    useful_tok_s: float | None = None  # tokens inside conversations a second; None: the batch had no padding


@dataclass(frozen=True)
class WorkerSettings:
    """What every drafter worker of an engine takes from the run's config: each field is the config key of its name
    (a new worker key is one field here), except the few ``from_config`` gives a form of their own."""

    ttt_steps: int
    total_steps: int  # the config's steps
    buckets: tuple[int, ...]  # the sequence lengths warmed up (compiled) before the first step
    batch_size: int
    grad_checkpointing: bool = False
    cast_weights_once: bool = True  # under autocast: the TTT steps share one cast of the weights (Drafter.forward)
    drafter_fp8: str = DRAFTER_FP8_OFF  # the Linears' GEMMs in FP8 (draft/fp8.py), on weights quantised once a step
    drafter_fp8_mlp: str = DRAFTER_FP8_MLP_COMPOSED  # "fused": gate and up as one FP8 node (draft/fp8_mlp.py)
    overlap_steps: str = "auto"  # the next forward launched before a step's numbers are read (config.py); auto: CUDA
    head_positions: str = HEAD_POSITIONS_TRAINED  # "trained": head and loss on the rows each step trains (rows.py)
    max_grad_norm: float = 1.0
    ema_decay: float = 0.0  # > 0: a moving average of the weights beside them (draft/average.py), in checkpoints
    nonfinite_grad_limit: int = 8  # skipped steps in a row that stop the run
    log_every: int = 1  # a step event every log_every steps (and at step 1)
    checkpoint_every: int = 0  # 0: no periodic checkpoint (only at the end and on a stop)
    step_delay_s: float = 0.0
    loss_fn: Callable[..., Any] = soft_cross_entropy  # loss.soft_cross_entropy, its masked-mean variant or an LK loss
    packing: bool = False  # batches carry documents (packed rows): the warm-up batches do too

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> WorkerSettings:
        own_form: dict[str, Any] = {
            "total_steps": cfg.steps,
            "buckets": tuple(cfg.buckets),
            "loss_fn": loss_function(cfg.loss_mean, cfg.loss, cfg.lk_kl_scale, cfg.lk_kl_decay),
        }
        return cls(**{f.name: own_form[f.name] if f.name in own_form else getattr(cfg, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class DrafterTraining:
    """One worker's model on its device and what updates it."""

    drafter: Drafter
    device: torch.device
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    attention: TTTAttention
    step_fn: GuardedFunction  # the TTT step (layer, head and loss); compiled on CUDA, shared by an engine's workers
    hidden_dtype: torch.dtype  # the target's hidden states as they arrive (the warm-up batches are made alike)
    autocast_dtype: torch.dtype | None
    # drafter_fp8: the weights' e4m3 layouts once a step (fp8.weight_layouts), shared like step_fn and compiled as it
    # is; None: drafter_fp8 off (or a caller's own DrafterTraining: the Drafter then quantises eagerly)
    fp8_layouts: GuardedFunction | None = None


@dataclass(frozen=True)
class WorkerLinks:
    """How a worker meets the rest of the engine: its input queue, the run's control, its model's ledger."""

    queue: BoundedQueue[DeviceBatch]
    control: ThreadControl
    ledger: IndexLedger  # the trained batch indices (replicas: shared, marked at the gradient barrier)
    group: ReplicaGroup | None = None  # the gradient barrier of replicas or of ranks; None: trains alone
    # Hands a periodic checkpoint's state over (None: this worker's states are not written, e.g. on rank > 0).
    submit_checkpoint: Callable[[int, str, dict[str, Any]], None] | None = None


class DrafterWorker:
    """One drafter thread: it trains ``training``'s model as ``settings`` say, on the batches ``links`` bring."""

    def __init__(
        self, name: str, rank: int, training: DrafterTraining, settings: WorkerSettings, links: WorkerLinks
    ) -> None:
        self.name = name
        self.rank = rank
        self.training = training
        self.settings = settings
        self.links = links
        self.weight_dtype = training.autocast_dtype if settings.cast_weights_once else None
        auto_overlap = settings.overlap_steps == "auto" and training.device.type == "cuda"
        self.overlap = settings.overlap_steps == "on" or auto_overlap
        self.nonfinite_in_a_row = 0
        self.current_index: int | None = None  # the batch being trained, not yet recorded in the ledger
        self.next_index: int | None = None  # the batch whose forward is launched ahead (overlap), not yet trained
        self.step = 0  # restore_state sets a resumed step
        self.params = training.drafter.trainable_parameters()
        decay = settings.ema_decay
        self.average = WeightAverage(training.drafter, decay) if decay > 0 else None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.finished = threading.Event()
        self.warm = threading.Event()
        self.warmup_s: float | None = None
        self.failed = False
        self.last_result: StepResult | None = None  # the latest step's losses, accuracies and timings
        self.final_state: dict[str, Any] | None = None
        self.stream: Any = None  # a CUDA stream shared with the other threads on this device, or None: own stream
        self._last_done: float | None = None
        links.control.health.register(name, "drafter")

    # --- the pieces -------------------------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        dtype = self.training.autocast_dtype
        return contextlib.nullcontext() if dtype is None else torch.autocast(self.training.device.type, dtype=dtype)

    def rows(self, batch: DeviceBatch) -> TrainedRows | None:
        """The rows each TTT step of ``batch`` trains (head_positions "trained"): the producer's, or made here."""
        if self.settings.head_positions != HEAD_POSITIONS_TRAINED:
            return None
        ttt = self.settings.ttt_steps
        if batch.rows is not None and len(batch.rows.index) >= ttt:
            return batch.rows
        return trained_rows(batch.position_mask, batch.documents, ttt)

    def forward(self, batch: DeviceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-TTT-position losses, correct counts and token counts of one batch (the unrolled drafter)."""
        rows = self.rows(batch)
        with self._autocast():
            out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = self.training.drafter(
                batch.hidden3,
                batch.input_ids,
                batch.target_logits,
                batch.target_lse,
                batch.position_mask,
                ttt_steps=self.settings.ttt_steps,
                attention=self.training.attention,
                loss_fn=self.settings.loss_fn,
                grad_checkpointing=self.settings.grad_checkpointing,
                step_fn=self.training.step_fn,
                loss_mask=batch.loss_mask,
                documents=batch.documents,
                weight_dtype=self.weight_dtype,
                fp8=self.settings.drafter_fp8,
                fp8_mlp=self.settings.drafter_fp8_mlp,
                fp8_layouts=self.training.fp8_layouts,
                rows=rows,
            )
        return out

    def forward_backward(self, batch: DeviceBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        losses, correct, counts = self.forward(batch)
        with lending_guard():  # under warm-up's guard: CUDA's autograd threads recompute checkpointed steps
            total_loss(losses).backward()
        return losses.detach(), correct.detach(), counts.detach()

    def synthetic_batch(self, bucket: int, prompt_share: float = WARMUP_PROMPT_SHARES[0]) -> DeviceBatch:
        """A warm-up batch of random tensors shaped as the producer's, each row's first ``prompt_share`` of
        positions untrained (a prompt)."""
        g = torch.Generator(device="cpu").manual_seed(bucket)
        cfg = self.training.drafter.cfg
        device, dtype = self.training.device, self.training.hidden_dtype
        b = self.settings.batch_size
        ids = torch.randint(0, cfg.vocab_size, (b, bucket), generator=g).to(device)
        hidden3 = torch.randn(b, bucket, 3 * cfg.hidden_size, generator=g).to(device, dtype)
        # The target's logits in its dtype, as the producer hands them, with their float32 log-sum-exp.
        target_logits = torch.randn(b, bucket, cfg.draft_vocab_size, generator=g).to(device, dtype)
        target_lse = torch.logsumexp(target_logits.float(), dim=-1)
        # A prompt untrained at the start of each row, as in conversations: the trained rows' counts (draft/rows.py)
        # stay below B*T in every TTT step, as real batches' do. A warm-up whose counts stepped over B*T (every
        # position trained: 8200 at B*T = 8192, TTT step 1) compiled that step again at the first real batch on an
        # H100 at the 8B shape, and counts below B*T did not.
        mask = (torch.arange(bucket) >= int(bucket * prompt_share)).float().expand(b, bucket).contiguous().to(device)
        # Packed runs warm up on packed rows (two conversations a row), so the first real batch compiles nothing.
        halves = (torch.arange(bucket) >= bucket // 2).long().expand(b, bucket).contiguous()
        documents = halves if self.settings.packing else None
        # A loss mask as trained on, and a tensor of its own: dynamo guards on two arguments being one tensor.
        return DeviceBatch(
            -1,
            bucket,
            ids,
            hidden3,
            target_logits,
            target_lse,
            mask,
            loss_mask=mask.clone(),
            documents=documents.to(device) if documents is not None else None,
        )

    def warm_up_shares(self) -> tuple[float, ...]:
        """The prompt shares warm-up trains at: both of WARMUP_PROMPT_SHARES where a compiled step takes a row
        count (head_positions "trained"), else the first alone."""
        rows = self.settings.head_positions == HEAD_POSITIONS_TRAINED
        return WARMUP_PROMPT_SHARES if rows and self.training.step_fn.compiled else WARMUP_PROMPT_SHARES[:1]

    def warm_up(self) -> float:
        """Forward and backward of every bucket under the compile guard (first compiles and block masks), at
        each of WARMUP_PROMPT_SHARES: a graph a count on one side of a row-count guard cannot take is made here,
        not at the first real batch on that side."""
        t0 = time.perf_counter()
        training = self.training
        with compile_guard():
            for bucket in self.settings.buckets:
                for share in self.warm_up_shares():
                    self.forward_backward(self.synthetic_batch(bucket, share))
                    training.optimizer.zero_grad(set_to_none=True)
            if training.device.type == "cuda":
                torch.cuda.synchronize(training.device)
        training.step_fn.mark_warm()  # a graph compiled in this thread from now on is a recompile (an event)
        training.attention.mark_warm()
        if training.fp8_layouts is not None:
            training.fp8_layouts.mark_warm()
        return time.perf_counter() - t0

    def begin(self, batch: DeviceBatch, fetch_ms: float) -> LaunchedStep:
        """Launches the forward of one batch (the TTT unroll through its losses); nothing waits for the GPU."""
        launched = LaunchedStep(batch, fetch_ms, self.training.device.type == "cuda")
        batch.wait_ready()
        launched.mark()
        launched.losses, launched.correct, launched.counts = self.forward(batch)
        launched.mark()
        return launched

    def finish(self, launched: LaunchedStep) -> tuple[PendingStep, bool]:
        """Launches the backward, the replicas' gradient exchange and the optimizer step of a launched forward, and
        the copy of its numbers to the host: (the step to ``report``, whether every replica stops after it).

        The gradients are clipped inside the fused optimizer (its ``grad_scale``: one pass over them, not two) and a
        non-finite norm skips the update there (its ``found_inf``), so no host check waits for the backward."""
        assert launched.losses is not None and launched.correct is not None and launched.counts is not None
        total_loss(launched.losses).backward()
        stop_after = False
        group, optimizer = self.links.group, self.training.optimizer
        if group is not None:
            for p in self.params if group.crosses_ranks else []:
                if p.grad is None:  # every replica and rank exchanges the same tensors, in the same order
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in self.params if p.grad is not None]
            stop_after = group.all_reduce(self.rank, grads, launched.batch.index, self.step + 1)
        launched.mark()
        # Checked after the reduce: every replica (and rank) sees the same sum, so all skip the same step. An update
        # with NaN in it would reach every replica and every later checkpoint.
        grad_norm = clipped_step(optimizer, self.params, self.settings.max_grad_norm)
        self.training.scheduler.step()  # the schedule follows the step count, skipped steps included
        optimizer.zero_grad(set_to_none=True)
        if self.average is not None:  # queued after the update; a skipped step moves it toward unchanged weights
            self.average.update()
        launched.mark()
        acc = accuracies(launched.correct.detach(), launched.counts.detach())
        values = torch.cat([launched.losses.detach().float(), acc.float(), grad_norm.detach().float().reshape(1)])
        return PendingStep(launched, values), stop_after

    def report(self, pending: PendingStep) -> StepResult:
        """Waits for a finished step's numbers and makes its result; raises on a non-finite loss, and stops the run
        when non-finite gradients keep coming."""
        values = pending.values()
        now = time.perf_counter()
        marks = pending.launched.marks
        if pending.launched.cuda:
            ms = [marks[i].elapsed_time(marks[i + 1]) for i in range(3)]
        else:
            ms = [(marks[i + 1] - marks[i]) * 1000.0 for i in range(3)]
        n = self.settings.ttt_steps
        step = self.step + 1
        batch = pending.launched.batch
        dt = now - self._last_done if self._last_done is not None else None
        self._last_done = now
        tok_s = batch.tokens / dt if dt else 0.0
        useful = batch.useful_tokens
        useful_tok_s = (useful / dt if dt else 0.0) if useful is not None and useful < batch.tokens else None
        result = StepResult(
            step=step,
            loss=values[:n],
            acc=values[n : 2 * n],
            grad_norm=values[-1],
            tok_s=tok_s,
            ms={"fetch": pending.launched.fetch_ms, "fwd": ms[0], "bwd": ms[1], "opt": ms[2]},
            skipped=not math.isfinite(values[-1]),
            useful_tok_s=useful_tok_s,
        )
        if not all(math.isfinite(v) for v in result.loss):
            raise NonFiniteLoss(f"non-finite loss {result.loss} at step {step} in thread {self.name}")
        if result.skipped:
            self._skip_nonfinite(step, result.grad_norm)
        else:
            self.nonfinite_in_a_row = 0
        return result

    def train_step(self, batch: DeviceBatch, fetch_ms: float) -> tuple[StepResult, bool]:
        """One whole step, launched and read back: (its result, whether every replica stops after it)."""
        pending, stop_after = self.finish(self.begin(batch, fetch_ms))
        return self.report(pending), stop_after

    def _skip_nonfinite(self, step: int, grad_norm: float) -> None:
        """Say the skipped step (an event the agent turns into an anomaly); stop once it keeps happening."""
        self.nonfinite_in_a_row += 1
        norm = str(grad_norm)  # "nan" / "inf": JSON has no such numbers
        limit = self.settings.nonfinite_grad_limit
        events = self.links.control.events
        events.emit(NonFiniteGradEvent(thread=self.name, step=step, grad_norm=norm, in_a_row=self.nonfinite_in_a_row))
        events.say(
            f"warning: {self.name} step {step}: gradient norm {norm}: step skipped, weights unchanged "
            f"({self.nonfinite_in_a_row} in a row, the run stops at {limit})"
        )
        if self.nonfinite_in_a_row >= limit:
            raise NonFiniteGradient(
                f"non-finite gradients (norm {norm}) for {self.nonfinite_in_a_row} steps in a row, the last at step "
                f"{step} in thread {self.name}; every one was skipped, the weights are those before them"
            )

    def averaged_drafter(self) -> Drafter:
        """ema_decay: a copy of the drafter holding the weights' moving average (what export serves)."""
        assert self.average is not None
        return self.average.swapped_in(self.training.drafter)

    def capture_state(self) -> dict[str, Any]:
        training = self.training
        return {
            "model": to_cpu(training.drafter.state_dict()),
            "optimizer": to_cpu(training.optimizer.state_dict()),
            "scheduler": training.scheduler.state_dict(),
            "step": self.step,
            "data_position": self.links.ledger.state(),
            "rng": rng_state(training.device),
            **({EMA_KEY: self.average.state()} if self.average is not None else {}),
        }

    def restore_state(self, state: dict[str, Any]) -> None:
        training = self.training
        training.drafter.load_state_dict(state["model"])
        # A copy: load_state_dict keeps a tensor already on the right device as is, so replicas on one device
        # restored from one state would share (and each update) the same moments.
        training.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        training.scheduler.load_state_dict(state["scheduler"])
        if self.average is not None:  # a checkpoint without one (ema_decay newly set) starts it from these weights
            self.average.restore(state.get(EMA_KEY))
        self.step = int(state["step"])
        # Checkpoints before the ledger kept one integer: every index below it trained.
        self.links.ledger.restore(state.get("data_position") or {"watermark": int(state.get("next_index", 0))})
        self._pending_rng = state["rng"]

    _pending_rng: dict[str, Any] | None = None

    # --- the thread -------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def _fetch(self, *, block: bool = True) -> DeviceBatch | None:
        """The next batch to train; None when the run ends first (or, ``block=False``, when none is queued now)."""
        t0 = time.perf_counter()
        links, control = self.links, self.links.control
        while not control.should_exit:
            try:
                batch = links.queue.get(timeout_s=GET_POLL_S if block else 0.0)
            except QueueTimeout:
                if not block:
                    return None
                control.health.beat(self.name, state="waiting", queue_depth=0)
                if links.group is None and control.stop_requested.is_set():
                    return None
                continue
            except QueueClosed:
                return None
            except ProducerFailed:
                # The producer's failure has already failed the run (thread_error, then queue.fail): it is the
                # root cause, named once. A drafter woken by it is not a second failure. Raised only if the run
                # still goes on, which queue.fail's one caller never leaves it doing.
                if control.should_exit:
                    return None
                raise
            if batch.index >= 0 and links.ledger.is_done(batch.index):
                continue  # independent mode: this drafter trained it before the resume
            self._fetch_ms = (time.perf_counter() - t0) * 1000.0
            return batch
        return None

    def held_indices(self) -> list[int]:
        """The batches this worker took and has not recorded as trained (the one in training, one launched ahead)."""
        return [i for i in (self.current_index, self.next_index) if i is not None]

    _fetch_ms = 0.0

    def _run(self) -> None:
        name_os_thread(self.thread.name)
        apply_dynamo_config()
        device, control, group = self.training.device, self.links.control, self.links.group
        stream_ctx: Any = contextlib.nullcontext()
        if device.type == "cuda":
            torch.cuda.set_device(device)
            stream_ctx = torch.cuda.stream(self.stream if self.stream is not None else torch.cuda.Stream(device))
        try:
            with stream_ctx:
                control.health.beat(self.name, state="warmup", step=self.step)
                control.events.stage("warmup", f"buckets {list(self.settings.buckets)} on {device}", thread=self.name)
                self.warmup_s = self.warm_up()
                control.events.stage(
                    "warmup",
                    f"done in {self.warmup_s:.1f} s ({'compiled' if self.training.step_fn.compiled else 'eager'})",
                    thread=self.name,
                )
                if self._pending_rng is not None:
                    set_rng_state(self._pending_rng, device)
                self.warm.set()
                self._loop()
        except BaseException as exc:
            self.failed = True
            if group is not None:
                try:
                    group.leave(self.rank)
                except BaseException as leave_exc:  # the cross-rank round inside leave() failed too
                    # The thread's own exception is the root cause: it must still reach thread_error below.
                    control.events.say(
                        f"warning: {self.name} could not leave its replica group: "
                        f"{type(leave_exc).__name__}: {leave_exc}"
                    )
            continuing = control.thread_error(self.name, "drafter", exc)
            if not continuing and group is not None:
                group.abort(exc)
        finally:
            self.warm.set()
            if not self.failed:
                control.health.beat(self.name, state="stopped", step=self.step)
            self.finished.set()
            control.wake.set()

    def _launch_next(self) -> LaunchedStep | None:
        """With ``overlap``: the next step's forward, launched while the GPU still runs this one's, when a batch is
        queued and a next step will run (steps remain, no stop asked for, no checkpoint due at this step: a state
        is captured with nothing launched after it)."""
        step = self.step + 1  # the step finishing now
        control, every = self.links.control, self.settings.checkpoint_every
        if not self.overlap or step >= self.settings.total_steps or control.should_exit:
            return None
        if self.links.group is None and control.stop_requested.is_set():
            return None
        if every and step % every == 0:
            return None
        batch = self._fetch(block=False)
        if batch is None:
            return None
        self.next_index = batch.index
        return self.begin(batch, self._fetch_ms)

    def _loop(self) -> None:
        ahead: LaunchedStep | None = None  # the next batch's forward, launched before this step's numbers were read
        settings, links, control, group = self.settings, self.links, self.links.control, self.links.group
        while self.step < settings.total_steps and not control.should_exit:
            if group is None and control.stop_requested.is_set():
                break  # a forward launched ahead is dropped: its batch stays untrained, to be trained on resume
            if ahead is None:
                control.health.beat(self.name, state="waiting", queue_depth=links.queue.depth())
                batch = self._fetch()
                if batch is None:
                    break
                self.current_index = batch.index
                control.health.beat(self.name, state="training", queue_depth=links.queue.depth())
                launched = self.begin(batch, self._fetch_ms)
            else:
                launched, ahead = ahead, None
                self.current_index, self.next_index = self.next_index, None
            batch = launched.batch
            pending, stop_after = self.finish(launched)
            if not stop_after:
                ahead = self._launch_next()
            result = self.report(pending)
            self.step = result.step
            if group is None:
                links.ledger.mark(batch.index)
            self.current_index = None
            self.last_result = result
            control.health.beat(
                self.name, state="training", step=self.step, tok_s=result.tok_s, queue_depth=links.queue.depth()
            )
            if self.step % settings.log_every == 0 or self.step == 1:
                loss_total = weighted_total(result.loss)
                control.events.emit(
                    StepEvent(
                        thread=self.name,
                        step=self.step,
                        loss=list(result.loss),
                        loss_total=loss_total,
                        acc=list(result.acc),
                        tok_s=result.tok_s,
                        useful_tok_s=result.useful_tok_s,
                        ms=dict(result.ms),
                        grad_norm=None if result.skipped else result.grad_norm,
                        skipped=result.skipped,
                        lr=float(self.training.scheduler.get_last_lr()[0]),
                        bucket=batch.bucket,
                        target_ms=batch.target_ms,
                    )
                )
                line = step_line(
                    self.name, self.step, result.loss, loss_total, result.acc, result.tok_s, result.useful_tok_s
                )
                control.events.say(line)
            # One state per model: the first live replica's (independent drafters are models of their own).
            leader = group is None or group.mode != "replicas" or self.rank == min(group.live)
            if (
                links.submit_checkpoint is not None
                and leader
                and settings.checkpoint_every
                and self.step % settings.checkpoint_every == 0
                and self.step < settings.total_steps
            ):
                links.submit_checkpoint(self.step, self.name, self.capture_state())
            if stop_after:
                break
            if settings.step_delay_s:
                control.stop_requested.wait(settings.step_delay_s)
        self.next_index = None  # a forward launched ahead and dropped: nothing of it was trained
        if not control.should_exit:
            self.final_state = self.capture_state()
