"""Per-thread health: each engine thread updates its status; the engine publishes heartbeats and flags.

Heartbeats are written every ``heartbeat_interval_s`` for every thread, stamped with the time that
thread last reported (so a stuck thread's heartbeat stops advancing), with ``beat_age_s`` and flags.

A thread that stops updating while it should be busy is flagged ``stalled``; a worker that has waited on an
empty queue for too long is flagged ``starving``. Stdlib only.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import HeartbeatEvent
from engine.trainer.threads.metrics import EventLog

ACTIVE_STATES = ("warmup", "training", "waiting", "syncing")  # syncing: at the replicas' gradient barrier


@dataclass
class ThreadStatus:
    name: str
    role: str  # "producer" | "drafter"
    state: str = "starting"
    step: int = 0
    tok_s: float = 0.0
    queue_depth: int | None = None
    last_exception: str | None = None
    last_beat: float = field(default_factory=time.monotonic)
    last_beat_wall: float = field(default_factory=time.time)
    waiting_since: float | None = None
    flags: list[str] = field(default_factory=list)


class HealthBoard:
    def __init__(self, events: EventLog, *, stall_after_s: float, starve_after_s: float) -> None:
        self.events = events
        self.stall_after_s = stall_after_s
        self.starve_after_s = starve_after_s
        self._lock = threading.Lock()
        self._threads: dict[str, ThreadStatus] = {}
        self._flagged: set[tuple[str, str]] = set()

    def register(self, name: str, role: str) -> None:
        with self._lock:
            self._threads[name] = ThreadStatus(name=name, role=role)

    def beat(self, name: str, **changes: Any) -> None:
        now = time.monotonic()
        with self._lock:
            st = self._threads[name]
            for key, value in changes.items():
                setattr(st, key, value)
            st.last_beat = now
            st.last_beat_wall = time.time()
            if st.state == "waiting":
                if st.waiting_since is None:
                    st.waiting_since = now
            else:
                st.waiting_since = None

    def status(self, name: str) -> ThreadStatus:
        with self._lock:
            st = self._threads[name]
            return ThreadStatus(**{k: getattr(st, k) for k in st.__dataclass_fields__})

    def names(self) -> list[str]:
        with self._lock:
            return list(self._threads)

    def publish(self) -> list[tuple[str, str]]:
        """Write one heartbeat event per thread; returns the flags newly raised as (thread, flag)."""
        now = time.monotonic()
        raised: list[tuple[str, str]] = []
        with self._lock:
            snapshot = list(self._threads.values())
            for st in snapshot:
                flags: list[str] = []
                if st.state in ACTIVE_STATES and now - st.last_beat > self.stall_after_s:
                    flags.append("stalled")
                if (
                    st.role == "drafter"
                    and st.waiting_since is not None
                    and now - st.waiting_since > self.starve_after_s
                ):
                    flags.append("starving")
                st.flags = flags
                for flag in flags:
                    if (st.name, flag) not in self._flagged:
                        self._flagged.add((st.name, flag))
                        raised.append((st.name, flag))
                for key in [k for k in self._flagged if k[0] == st.name and k[1] not in flags]:
                    self._flagged.discard(key)
            beats = [
                HeartbeatEvent(
                    # t is when the thread last beat, not when this line was written: a hung thread's
                    # heartbeats age (the agent flags a dead thread by heartbeat age).
                    t=st.last_beat_wall,
                    thread=st.name,
                    role=st.role,
                    state=st.state,
                    step=st.step,
                    tok_s=st.tok_s,
                    queue_depth=st.queue_depth,
                    last_exception=st.last_exception,
                    flags=list(st.flags),
                    beat_age_s=round(now - st.last_beat, 3),
                )
                for st in snapshot
            ]
        for beat in beats:
            self.events.emit(beat)
        return raised


def name_os_thread(name: str) -> None:
    """Give the calling thread its OS name (Linux comm, 15 bytes), so `ps -L`, py-spy and the agent's
    process tree show `drafter0` instead of `python3`. Python < 3.14 only names threads inside Python."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_name = 15
        libc.prctl(pr_set_name, name.encode("utf-8", "replace")[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux or no prctl: the Python-level name still shows in stack dumps
