"""Which batch index each producer computes next and which drafters train it: every index trained exactly once.

Producers claim indices from one shared counter, so no producer owns a share: a producer that dies gives its
claimed index back (``release``) and the live ones go on. A ledger per trained model records the indices
trained as a watermark (every index below it trained) plus the indices trained above it, so a checkpoint's
data position is exact even when batches arrive out of order, and a resumed run trains only what is missing.

``replicas`` mode: the replicas train one model, so they share one ledger, and each batch goes to one live
replica (round robin over deliveries, so the replicas' queues fill evenly and none waits at the gradient
barrier for a batch that went elsewhere). ``independent`` mode: one ledger per drafter; every live drafter
gets every index it has not trained. A drafter that dies is retired: nothing is routed to it again.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Iterable
from typing import Any


class IndexLedger:
    """The batch indices one model has trained: all below ``watermark``, plus ``done`` above it."""

    def __init__(self, watermark: int = 0, done: Iterable[int] = ()) -> None:
        self._lock = threading.Lock()
        self._watermark = watermark
        self._done: set[int] = set()
        for i in done:
            self._add(i)

    def _add(self, index: int) -> None:
        if index >= self._watermark:
            self._done.add(index)
        while self._watermark in self._done:
            self._done.discard(self._watermark)
            self._watermark += 1

    def mark(self, index: int) -> None:
        with self._lock:
            self._add(index)

    def is_done(self, index: int) -> bool:
        with self._lock:
            return index < self._watermark or index in self._done

    @property
    def watermark(self) -> int:
        with self._lock:
            return self._watermark

    @property
    def trained(self) -> int:
        """How many indices are recorded as trained."""
        with self._lock:
            return self._watermark + len(self._done)

    def state(self) -> dict[str, Any]:
        """The checkpoint's data position: ``{"watermark": W, "done": [indices above W]}``."""
        with self._lock:
            return {"watermark": self._watermark, "done": sorted(self._done)}

    def restore(self, state: dict[str, Any]) -> None:
        with self._lock:
            self._watermark = int(state["watermark"])
            self._done = set()
            for i in state.get("done", []):
                self._add(int(i))


class Dispatcher:
    """Shared by the producers: hands out batch indices and says which drafters each one goes to."""

    def __init__(self, ledgers: list[IndexLedger], mode: str) -> None:
        if mode not in ("replicas", "independent"):
            raise ValueError(f"unknown drafter mode {mode!r}")
        self.mode = mode
        self._ledgers = ledgers  # one per drafter rank (replicas: the same ledger at every rank)
        self._live = set(range(len(ledgers)))
        self._lock = threading.Lock()
        self._next = min(ledger.watermark for ledger in ledgers)
        self._returned: list[int] = []  # released indices, handed out again first (lowest first)
        self._turn = 0

    def _wanted(self, index: int) -> bool:
        return any(not self._ledgers[r].is_done(index) for r in self._live)

    def claim(self) -> int:
        """The next batch index some live drafter still has to train."""
        with self._lock:
            while self._returned:
                index = heapq.heappop(self._returned)
                if self._wanted(index):
                    return index
            while True:
                index = self._next
                self._next += 1
                if not self._live or self._wanted(index):
                    return index

    def release(self, index: int) -> None:
        """Give a claimed index back (its producer died, or its drafter died before training it)."""
        with self._lock:
            if index not in self._returned:
                heapq.heappush(self._returned, index)

    def retire(self, rank: int) -> None:
        """A drafter died: nothing is routed to it any more."""
        with self._lock:
            self._live.discard(rank)

    def next_replica(self) -> int | None:
        """Replicas mode: the live replica that gets the next batch (round robin), None when none is live."""
        with self._lock:
            live = sorted(self._live)
            if not live:
                return None
            rank = live[self._turn % len(live)]
            self._turn += 1
            return rank

    def destinations(self, index: int) -> list[int]:
        """Independent mode: the live drafters that have not trained ``index``."""
        with self._lock:
            return [r for r in sorted(self._live) if not self._ledgers[r].is_done(index)]
