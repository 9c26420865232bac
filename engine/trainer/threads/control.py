"""Run control shared by the engine's threads: stop requests, failures, thread errors and checkpoint rounds."""

from __future__ import annotations

import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import ThreadErrorEvent
from engine.trainer.threads.health import HealthBoard
from engine.trainer.threads.metrics import EventLog


class NonFiniteLoss(RuntimeError):
    """A loss that is NaN or infinite: the run stops, naming the step and the thread."""


class NonFiniteGradient(RuntimeError):
    """Gradients that stayed NaN or infinite for ``nonfinite_grad_limit`` steps in a row: each was skipped (the
    weights never took one), and the run stops, naming the thread and the steps."""


class PeerFailure(RuntimeError):
    """A collective across ranks failed: a peer rank died or timed out. The rank stops; the message names the peer."""


@dataclass
class ThreadFailure:
    thread: str
    role: str
    exc_type: str
    message: str
    traceback: str


@dataclass
class ThreadControl:
    events: EventLog
    health: HealthBoard
    policy: str  # "stop" | "continue"
    stop_requested: threading.Event = field(default_factory=threading.Event)  # graceful: next step boundary
    abort: threading.Event = field(default_factory=threading.Event)  # failure: leave now, no checkpoint
    wake: threading.Event = field(default_factory=threading.Event)  # wakes the engine's monitor loop
    producers_stop: threading.Event = field(default_factory=threading.Event)  # set once the drafters are done
    failures: list[ThreadFailure] = field(default_factory=list)
    stop_reason: str | None = None
    abort_reason: str | None = None
    on_failure: list[Callable[[ThreadFailure, bool], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def request_stop(self, reason: str) -> None:
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = reason
        self.stop_requested.set()
        self.wake.set()

    def fail_run(self, reason: str) -> None:
        with self._lock:
            if self.abort_reason is None:
                self.abort_reason = reason
        self.abort.set()
        self.stop_requested.set()
        self.producers_stop.set()
        self.wake.set()

    @property
    def should_exit(self) -> bool:
        return self.abort.is_set()

    def thread_error(self, thread: str, role: str, exc: BaseException, *, force_stop: bool = False) -> bool:
        """Log the traceback, write the ``thread_error`` event at once and apply the policy.

        Returns True when the run goes on without this thread (policy ``continue``).
        """
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        policy = "stop" if force_stop or isinstance(exc, (NonFiniteLoss, PeerFailure)) else self.policy
        failure = ThreadFailure(thread, role, type(exc).__name__, str(exc), tb)
        with self._lock:
            self.failures.append(failure)
        sys.stderr.write(f"thread {thread} raised:\n{tb}")
        sys.stderr.flush()
        self.events.emit(
            ThreadErrorEvent(
                thread=thread,
                role=role,
                exc_type=failure.exc_type,
                message=failure.message,
                traceback=tb,
                policy=policy,
            )
        )
        self.health.beat(thread, state="error", last_exception=f"{failure.exc_type}: {failure.message}")
        continuing = policy == "continue"
        for fn in list(self.on_failure):
            fn(failure, continuing)
        if continuing:
            self.events.say(f"thread {thread} died ({failure.exc_type}: {failure.message}); running degraded")
        else:
            self.fail_run(f"thread {thread} failed: {failure.exc_type}: {failure.message}")
        self.wake.set()
        return continuing


class CheckpointRounds:
    """Collects each drafter's state for a step; the last one in writes the checkpoint."""

    def __init__(self, expected: set[str], write: Callable[[int, dict[str, dict[str, Any]]], None]) -> None:
        self._expected = set(expected)
        self._write = write
        self._rounds: dict[int, dict[str, dict[str, Any]]] = {}
        self._lock = threading.Lock()

    def drop(self, name: str) -> None:
        """A drafter that died no longer holds up rounds."""
        with self._lock:
            self._expected.discard(name)
            ready = [s for s, got in self._rounds.items() if self._expected and self._expected <= set(got)]
            todo = [(s, self._rounds.pop(s)) for s in ready]
        for step, states in todo:
            self._write(step, states)

    def submit(self, step: int, name: str, state: dict[str, Any]) -> None:
        with self._lock:
            got = self._rounds.setdefault(step, {})
            got[name] = state
            if not self._expected <= set(got):
                return
            states = self._rounds.pop(step)
        self._write(step, states)
