"""Target producers: one thread per target replica, feeding the drafters' bounded queues.

Each producer claims its next batch index from the shared ``Dispatcher`` (so a dead producer's share is taken
over by the live ones), runs the target on it and delivers it: in ``replicas`` mode to one live drafter (data
parallel), in ``independent`` mode to every live drafter that has not trained it. A batch whose drafter died
before taking it goes to another live replica. On CUDA each producer runs on its own stream and hands each
batch over with a CUDA event.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.trainer.data.dispatch import Dispatcher
from engine.trainer.data.sources import BatchSource, HostBatch
from engine.trainer.draft.rows import TrainedRows, trained_rows
from engine.trainer.threads.compile import apply_dynamo_config
from engine.trainer.threads.control import ThreadControl
from engine.trainer.threads.health import name_os_thread
from engine.trainer.threads.queue import BoundedQueue, QueueClosed, QueueTimeout
from engine.trainer.verifier.model import FrozenTarget, TargetOutput

PUT_POLL_S = 0.25


@dataclass
class DeviceBatch:
    index: int
    bucket: int
    input_ids: torch.Tensor  # (B, T) long
    hidden3: torch.Tensor  # (B, T, 3H)
    target_logits: torch.Tensor  # (B, T, Vd): the target's over the draft vocabulary (draft/loss.py)
    target_lse: torch.Tensor  # (B, T) float32: their log-sum-exp
    position_mask: torch.Tensor  # (B, T) float32
    ready: Any = None  # torch.cuda.Event recorded after the tensors were written, or None on the CPU
    target_ms: float = 0.0
    loss_mask: torch.Tensor | None = None  # (B, T) the data's loss mask: the accuracy's denominator (loss.py)
    documents: torch.Tensor | None = None  # (B, T) packed rows' conversation numbers (data/packing.py), or None
    useful_tokens: int | None = None  # tokens inside conversations (None: every token is)
    rows: TrainedRows | None = None  # the rows each TTT step trains (draft/rows.py), made by the producer, or None

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    def wait_ready(self) -> None:
        if self.ready is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.ready)
            tensors = (self.input_ids, self.hidden3, self.target_logits, self.target_lse, self.position_mask)
            rows = (*self.rows.index, *self.rows.weight) if self.rows is not None else ()
            for t in (*tensors, self.loss_mask, self.documents, *rows):
                if t is not None:
                    t.record_stream(stream)


@dataclass
class Route:
    queue: BoundedQueue[DeviceBatch]
    device: torch.device


@dataclass
class TargetBatch:
    """One batch through the target, on the target's device: what a producer hands its drafters."""

    host: HostBatch
    input_ids: torch.Tensor  # (B, T) long
    documents: torch.Tensor | None  # (B, T) packed rows' conversation numbers on the target device, or None
    target: TargetOutput  # hidden states, target distribution and masks of those ids
    ready: Any  # torch.cuda.Event recorded after the target's forward, or None on the CPU
    target_ms: float
    rows: TrainedRows | None = None  # the rows each TTT step trains (draft/rows.py), when the drafters want them


class Producer:
    def __init__(
        self,
        name: str,
        target: FrozenTarget,
        source: BatchSource,
        routes: list[Route],
        dispatcher: Dispatcher,
        *,
        start_batches: int,
        draft_ids: torch.Tensor,
        t2d: torch.Tensor,
        control: ThreadControl,
        rows_ttt_steps: int = 0,
    ) -> None:
        """``rows_ttt_steps``: make each batch's ``trained_rows`` for that many TTT steps (0: none; the drafters'
        head_positions "trained"): here, right after the target's forward, the one read of their counts to the
        host waits for the target, not for a drafter."""
        self.name = name
        self.target = target
        self.source = source
        self.routes = routes
        self.dispatcher = dispatcher
        self.draft_ids = draft_ids.to(target.device)
        self.t2d = t2d.to(target.device)
        self.control = control
        self.rows_ttt_steps = rows_ttt_steps
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.finished = threading.Event()
        self.failed = False
        # Batches produced, counted from the resumed data position, so the heartbeat's step goes on after a restart.
        self.batches = start_batches
        self.claimed: int | None = None  # the index being produced; given back if this thread dies
        self.stream: Any = None  # a CUDA stream shared with the other threads on this device, or None: own stream
        control.health.register(name, "producer")
        control.health.beat(name, step=self.batches)

    def start(self) -> None:
        self.thread.start()

    def compute(self, index: int) -> TargetBatch:
        """Batch ``index`` through the target: hidden states and target distributions on the target device."""
        dev = self.target.device
        t0 = time.perf_counter()
        hb = self.source.batch(index)
        ids = hb.input_ids.to(dev, non_blocking=True)
        mask = hb.loss_mask.to(dev, non_blocking=True)
        docs = hb.documents.to(dev, non_blocking=True) if hb.documents is not None else None
        # In the dtype the target was loaded in; packed rows: no token attends across a conversation.
        out = self.target.run(ids, mask, self.draft_ids, self.t2d, documents=docs)
        rows = trained_rows(out.position_mask, docs, self.rows_ttt_steps) if self.rows_ttt_steps else None
        ready = None
        if dev.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        ms = (time.perf_counter() - t0) * 1000.0
        return TargetBatch(hb, ids, docs, out, ready, ms, rows)

    def _batch_for(self, route: Route, out: TargetBatch) -> DeviceBatch:
        got = out.target
        tensors = [out.input_ids, got.hidden3, got.target_logits, got.target_lse, got.position_mask, got.loss_mask]
        documents, rows = out.documents, out.rows
        if route.device != self.target.device:
            tensors = [t.to(route.device, non_blocking=True) for t in tensors]
            documents = documents.to(route.device, non_blocking=True) if documents is not None else None
            rows = rows.to(route.device, non_blocking=True) if rows is not None else None
        ready = out.ready
        if route.device != self.target.device and self.target.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        batch = DeviceBatch(
            out.host.index,
            out.host.bucket,
            tensors[0],
            tensors[1],
            tensors[2],
            tensors[3],
            tensors[4],
            loss_mask=tensors[5],
            documents=documents,
            useful_tokens=out.host.useful_tokens,
            rows=rows,
        )
        batch.ready = ready
        batch.target_ms = out.target_ms
        return batch

    def _put(self, rank: int, out: TargetBatch) -> str:
        """``"ok"``, ``"closed"`` (that drafter's queue is closed: it died) or ``"stop"`` (the run is stopping)."""
        route = self.routes[rank]
        batch = self._batch_for(route, out)
        while not self.control.producers_stop.is_set():
            try:
                route.queue.put(batch, timeout_s=PUT_POLL_S)
                return "ok"
            except QueueTimeout:
                self.control.health.beat(self.name, state="waiting", queue_depth=route.queue.depth())
            except QueueClosed:
                return "stop" if self.control.producers_stop.is_set() else "closed"
        return "stop"

    def deliver(self, out: TargetBatch) -> bool:
        """Put the batch on its drafters' queues; False when the run is stopping."""
        if self.dispatcher.mode == "replicas":
            while True:
                rank = self.dispatcher.next_replica()
                if rank is None:
                    return False
                got = self._put(rank, out)
                if got == "ok":
                    return True
                if got == "stop":
                    return False
                self.dispatcher.retire(rank)  # closed while the run goes on: that replica died; another takes it
        # A "closed" queue (a drafter that died) is skipped: the other drafters still get the batch.
        return all(self._put(rank, out) != "stop" for rank in self.dispatcher.destinations(out.host.index))

    def _run(self) -> None:
        name_os_thread(self.thread.name)
        apply_dynamo_config()
        stream_ctx: Any = contextlib.nullcontext()
        if self.target.device.type == "cuda":
            torch.cuda.set_device(self.target.device)
            stream_ctx = torch.cuda.stream(
                self.stream if self.stream is not None else torch.cuda.Stream(self.target.device)
            )
        try:
            with stream_ctx, torch.no_grad():
                self.control.health.beat(self.name, state="training", step=self.batches)
                while not self.control.producers_stop.is_set():
                    t0 = time.perf_counter()
                    self.claimed = self.dispatcher.claim()
                    out = self.compute(self.claimed)
                    if not self.deliver(out):
                        return
                    self.claimed = None
                    self.batches += 1
                    dt = max(time.perf_counter() - t0, 1e-9)
                    self.control.health.beat(
                        self.name,
                        state="training",
                        step=self.batches,
                        tok_s=out.host.tokens / dt,
                        queue_depth=min(r.queue.depth() for r in self.routes),
                    )
        except BaseException as exc:
            self.failed = True
            if self.claimed is not None:
                self.dispatcher.release(self.claimed)  # the live producers produce it instead
            continuing = self.control.thread_error(self.name, "producer", exc)
            if not continuing:
                for route in self.routes:
                    route.queue.fail(exc, self.name)
        finally:
            self.finished.set()
            if self.control.health.status(self.name).state != "error":
                self.control.health.beat(self.name, state="stopped")
            self.control.wake.set()
