"""A bounded queue between target producers and one drafter worker, with close and error propagation.

``put`` blocks while the queue is full; ``get`` blocks while it is empty. ``close()`` lets the consumer
drain what is left and then raises ``QueueClosed`` (``drain()`` takes what is left at once, for a dead
consumer); ``fail(exc)`` makes the next ``get`` raise ``ProducerFailed`` at once (the producer's exception
never vanishes). Both wake every waiter.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueClosed(Exception):
    """The queue was closed and is empty (consumer) or closed (producer)."""


class QueueTimeout(Exception):
    """Nothing arrived (or no room freed) within the timeout."""


class ProducerFailed(Exception):
    """A producer raised; the original exception is the ``__cause__`` and ``.error``."""

    def __init__(self, error: BaseException, producer: str) -> None:
        super().__init__(f"producer {producer} failed: {type(error).__name__}: {error}")
        self.error = error
        self.producer = producer


class BoundedQueue(Generic[T]):
    def __init__(self, maxsize: int, name: str = "queue") -> None:
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize
        self.name = name
        self._items: collections.deque[T] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._failure: ProducerFailed | None = None

    def put(self, item: T, timeout_s: float | None = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while len(self._items) >= self.maxsize and not self._closed and self._failure is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise QueueTimeout(f"{self.name}: full for {timeout_s} s")
                self._cond.wait(remaining)
            if self._closed or self._failure is not None:
                raise QueueClosed(f"{self.name} is closed")
            self._items.append(item)
            self._cond.notify_all()

    def get(self, timeout_s: float | None = None) -> T:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._failure is not None:
                    raise self._failure
                if self._items:
                    item = self._items.popleft()
                    self._cond.notify_all()
                    return item
                if self._closed:
                    raise QueueClosed(f"{self.name} is closed")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise QueueTimeout(f"{self.name}: empty for {timeout_s} s")
                self._cond.wait(remaining)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> list[T]:
        """Take every item left (a dead consumer's queue: its batches go elsewhere)."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
            self._cond.notify_all()
            return items

    def fail(self, error: BaseException, producer: str) -> None:
        with self._cond:
            if self._failure is None:
                failure = ProducerFailed(error, producer)
                failure.__cause__ = error
                self._failure = failure
            self._items.clear()
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def depth(self) -> int:
        with self._cond:
            return len(self._items)
