"""The bounded wait of ``support.waiting`` for a Textual app under test: between two looks the pilot pauses, so
the app handles its messages and redraws meanwhile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from support.waiting import wait_until_async

T = TypeVar("T")


async def wait_until(pilot: Any, predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "") -> T:
    """Let the app run until ``predicate()`` is truthy; AssertionError naming ``what`` after ``timeout_s``."""
    return await wait_until_async(predicate, timeout_s, what or repr(predicate), pause=pilot.pause)
