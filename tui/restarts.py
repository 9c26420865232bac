"""A run's restarts (RunInfo.restarts, under a profile's restart policy) in words: header, timeline, status."""

from __future__ import annotations

import time
from typing import Any

from engine.protocol import RunInfo

_STATE_WORDS = {"backoff": "restarting", "gave_up": "gave up", "cancelled": "cancelled by stop"}


def restarts_of(run: RunInfo | None) -> list[dict[str, Any]]:
    return list(run.restarts) if run is not None else []


def summary(run: RunInfo | None) -> str | None:
    """ "restarts 2/3 (crash, oom)", with "restarting" / "gave up" when so; None for a run without a restart policy."""
    if run is None or run.restart_max is None:
        return None
    items = restarts_of(run)
    text = f"restarts {len(items)}/{run.restart_max}"
    if items:
        text += f" ({', '.join(str(r.get('cause')) for r in items)})"
    state = _STATE_WORDS.get(str(run.restart_state))
    return f"{text}, {state}" if state else text


def line(index: int, item: dict[str, Any], max_restarts: int | None) -> str:
    """One restart: "restart 1/3 at 03:12:09: crash: ValueError: first; exited with code 1", the attempt's own
    cause (``reason``) before how it ended."""
    at = item.get("at")
    when = f" at {time.strftime('%H:%M:%S', time.localtime(at))}" if isinstance(at, (int, float)) else ""
    of = f"/{max_restarts}" if max_restarts is not None else ""
    detail = item.get("detail") or (f"exit code {item.get('exit_code')}" if item.get("exit_code") is not None else "")
    reason = item.get("reason")
    said = "; ".join(str(x) for x in (reason, detail) if x)
    return f"restart {index}{of}{when}: {item.get('cause')}" + (f": {said}" if said else "")
