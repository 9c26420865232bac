"""Target producers: one thread per target replica, feeding the drafters' bounded queues.

Producer ``p`` of ``P`` reads batch indices ``start + p, start + p + P, ...``. In ``replicas`` mode batch
``k`` goes to drafter ``k % n`` (data parallel); in ``independent`` mode every drafter gets every batch.
On CUDA each producer runs on its own stream and hands each batch over with a CUDA event.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.trainer.compile import apply_dynamo_config
from engine.trainer.control import RunControl
from engine.trainer.data import BatchSource
from engine.trainer.health import name_os_thread
from engine.trainer.queue import BoundedQueue, QueueClosed, QueueTimeout
from engine.trainer.target import Target

PUT_POLL_S = 0.25


@dataclass
class DeviceBatch:
    index: int
    bucket: int
    input_ids: torch.Tensor  # (B, T) long
    hidden3: torch.Tensor  # (B, T, 3H)
    target_p: torch.Tensor  # (B, T, Vd) float32
    position_mask: torch.Tensor  # (B, T) float32
    ready: Any = None  # torch.cuda.Event recorded after the tensors were written, or None on the CPU
    target_ms: float = 0.0
    loss_mask: torch.Tensor | None = None  # (B, T) the data's loss mask: the accuracy's denominator (loss.py)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    def wait_ready(self) -> None:
        if self.ready is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.ready)
            for t in (self.input_ids, self.hidden3, self.target_p, self.position_mask, self.loss_mask):
                if t is not None:
                    t.record_stream(stream)


@dataclass
class Route:
    queue: BoundedQueue[DeviceBatch]
    device: torch.device


class Producer:
    def __init__(
        self,
        name: str,
        target: Target,
        source: BatchSource,
        routes: list[Route],
        *,
        mode: str,
        start_index: int,
        offset: int,
        stride: int,
        draft_ids: torch.Tensor,
        t2d: torch.Tensor,
        control: RunControl,
        autocast_dtype: torch.dtype | None,
    ) -> None:
        self.name = name
        self.target = target
        self.source = source
        self.routes = routes
        self.mode = mode
        self.next_index = start_index + offset
        self.stride = stride
        self.draft_ids = draft_ids.to(target.device)
        self.t2d = t2d.to(target.device)
        self.control = control
        self.autocast_dtype = autocast_dtype
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.finished = threading.Event()
        self.batches = 0
        self.stream: Any = None  # a CUDA stream shared with the other threads on this device, or None: own stream
        self.inject_error: BaseException | None = None  # tests: raise this at the next batch
        control.health.register(name, "producer")

    def start(self) -> None:
        self.thread.start()

    def _destinations(self, index: int) -> list[Route]:
        if self.mode == "replicas":
            return [self.routes[index % len(self.routes)]]
        return self.routes

    def _put(self, route: Route, batch: DeviceBatch) -> bool:
        while not self.control.producers_stop.is_set():
            try:
                route.queue.put(batch, timeout_s=PUT_POLL_S)
                return True
            except QueueTimeout:
                self.control.health.beat(self.name, state="waiting", queue_depth=route.queue.depth())
            except QueueClosed:
                return False
        return False

    def _produce(self, index: int) -> list[tuple[Route, DeviceBatch]]:
        dev = self.target.device
        t0 = time.perf_counter()
        hb = self.source.batch(index)
        ids = hb.input_ids.to(dev, non_blocking=True)
        mask = hb.loss_mask.to(dev, non_blocking=True)
        ctx = (
            torch.autocast(dev.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        with ctx:
            out = self.target.run(ids, mask, self.draft_ids, self.t2d)
        result: list[tuple[Route, DeviceBatch]] = []
        for route in self._destinations(index):
            same = route.device == dev
            tensors = [ids, out.hidden3, out.target_p, out.position_mask, out.loss_mask]
            if not same:
                tensors = [t.to(route.device, non_blocking=True) for t in tensors]
            batch = DeviceBatch(
                index, hb.bucket, tensors[0], tensors[1], tensors[2], tensors[3], loss_mask=tensors[4]
            )
            result.append((route, batch))
        ready = None
        if dev.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        ms = (time.perf_counter() - t0) * 1000.0
        for _route, batch in result:
            batch.ready = ready
            batch.target_ms = ms
        return result

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
                self.control.health.beat(self.name, state="training")
                while not self.control.producers_stop.is_set():
                    if self.inject_error is not None:
                        raise self.inject_error
                    t0 = time.perf_counter()
                    produced = self._produce(self.next_index)
                    for route, batch in produced:
                        if not self._put(route, batch):
                            return
                    self.batches += 1
                    self.next_index += self.stride
                    tokens = sum(b.tokens for _r, b in produced[:1])
                    dt = max(time.perf_counter() - t0, 1e-9)
                    self.control.health.beat(
                        self.name,
                        state="training",
                        step=self.batches,
                        tok_s=tokens / dt,
                        queue_depth=min(r.queue.depth() for r in self.routes),
                    )
        except BaseException as exc:
            continuing = self.control.thread_error(self.name, "producer", exc)
            if not continuing:
                for route in self.routes:
                    route.queue.fail(exc, self.name)
        finally:
            self.finished.set()
            if self.control.health.status(self.name).state != "error":
                self.control.health.beat(self.name, state="stopped")
            self.control.wake.set()
