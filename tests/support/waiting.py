"""One bounded wait for everything a test waits on: poll a predicate until it holds, or fail saying what was
awaited and what was last seen. A test never sleeps a fixed time hoping something happened."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_INTERVAL_S = 0.02
LAST_VALUE_CHARS = 500  # a long snapshot (a whole status) is cut: the head says what it was
LAST_TEXT_CHARS = 4000  # of a text (a terminal screen, a log) the end is shown: where it stopped


def _timed_out(what: str, timeout_s: float, last: object) -> AssertionError:
    if isinstance(last, str) and last:  # a screen or a log: its lines as they are, the end of it
        shown = "\n" + last[-LAST_TEXT_CHARS:]
    else:
        shown = repr(last)
        if len(shown) > LAST_VALUE_CHARS:
            shown = shown[:LAST_VALUE_CHARS] + f"... ({len(shown)} chars)"
    return AssertionError(f"timed out after {timeout_s} s waiting for {what}; last seen: {shown}")


class _Bound:
    """The deadline of one wait and what to say when it passes."""

    def __init__(self, timeout_s: float, what: str, observe: Callable[[], object] | None) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s, self.what, self.observe = timeout_s, what, observe

    def met(self, value: object) -> bool:
        """True once ``value`` is truthy; raises once the deadline has passed without it."""
        if value:
            return True
        if time.monotonic() > self.deadline:
            raise _timed_out(self.what, self.timeout_s, self.observe() if self.observe is not None else value)
        return False


def wait_until(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    observe: Callable[[], object] | None = None,
    interval_s: float = POLL_INTERVAL_S,
) -> T:
    """The first truthy value of ``predicate()``; AssertionError naming ``what`` after ``timeout_s``, with the
    predicate's last value, or ``observe()`` where a bare False would say nothing (the log that lacks a line)."""
    bound = _Bound(timeout_s, what, observe)
    while not bound.met(value := predicate()):
        time.sleep(interval_s)
    return value


async def wait_until_async(
    predicate: Callable[[], T],
    timeout_s: float,
    what: str,
    *,
    observe: Callable[[], object] | None = None,
    pause: Callable[[float], Awaitable[object]] = asyncio.sleep,
    interval_s: float = POLL_INTERVAL_S,
) -> T:
    """``wait_until`` inside an event loop: ``pause`` (``asyncio.sleep``, or a Textual pilot's ``pause`` so the
    app runs meanwhile) lets the loop work between two looks."""
    bound = _Bound(timeout_s, what, observe)
    while not bound.met(value := predicate()):
        await pause(interval_s)
    return value
