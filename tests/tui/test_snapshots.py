"""Snapshots of the dashboard in the states a person must tell apart at a glance.

Deterministic: recorded events, a fixed clock, a fixed terminal size, no live timers (flushes by
hand), no cursor blink. Update with ``pytest tests/tui/test_snapshots.py --snapshot-update``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tui_recorded import (
    RUN_ID,
    T0,
    RecordingSession,
    engine_events,
    gpu,
    gpus_event,
    healthy_events,
    hello,
    log_events,
    run,
)

from tui.dashboard.app import DashboardApp

SIZE = (140, 44)
STALE_HOLDER = {
    "pid": 901,
    "resolved": True,
    "create_time": T0 - 86400,
    "user": "alice",
    "cmd": "python old_train.py",
    "gpus": [1],
    "used_mib": 30_000.0,
    "state": "sleeping",
    "age_s": 86400.0,
    "in_run": False,
    "source": "fd",
}


def log_end(events: list[dict[str, Any]]) -> int:
    """The byte after the last log event: where the next recorded chunk starts."""
    from engine.protocol import decode_log_data

    return max((e["offset"] + len(decode_log_data(e["data"])) for e in events if e.get("ev") == "log"), default=0)


def app_with(events: list[dict[str, Any]], session: RecordingSession | None = None) -> DashboardApp:
    session = session or RecordingSession()
    app = DashboardApp(session, flush_interval_s=None, clock=lambda: T0 + 41.5, connect=False)

    async def feed(pilot: Any) -> None:
        await pilot.pause()
        session.emit(*events)
        app.flush_events(force_charts=True)

    app.snapshot_feed = feed  # type: ignore[attr-defined]
    return app


def compare(snap_compare: Callable[..., bool], app: DashboardApp) -> bool:
    return snap_compare(app, terminal_size=SIZE, run_before=app.snapshot_feed)  # type: ignore[attr-defined]


def test_healthy_run(snap_compare: Callable[..., bool]) -> None:
    assert compare(snap_compare, app_with(healthy_events()))


def test_failed_launch_shows_the_cause(snap_compare: Callable[..., bool]) -> None:
    logs, _ = log_events(["bash: line 1: cd: /root/work: No such file or directory"])
    events = [
        hello(),
        gpus_event([gpu(0, 0, 0), gpu(1, 0, 0)]),
        run(state="failed", exit_code=1, milestones={"submitted": T0, "started": T0 + 0.2}, stage=None),
        {"ev": "milestone", "run_id": RUN_ID, "milestone": "submitted", "t": T0, "ok": True, "cause": None},
        {"ev": "milestone", "run_id": RUN_ID, "milestone": "started", "t": T0 + 0.2, "ok": True, "cause": None},
        *logs,
        {
            "ev": "milestone",
            "run_id": RUN_ID,
            "milestone": "output",
            "t": T0 + 0.4,
            "ok": False,
            "cause": "the job exited with code 1 after 0.2 s: bash: line 1: cd: /root/work: No such file or directory",
        },
        {"ev": "procs", "t": T0, "run_tree": [], "holders": []},
    ]
    assert compare(snap_compare, app_with(events))


def test_gpu_with_phantom_utilization(snap_compare: Callable[..., bool]) -> None:
    events = [
        hello(),
        gpus_event([gpu(0, 100, 0), gpu(1, 3, 30_000, holders=[901])]),
        {"ev": "run", "run": None},
        {"ev": "procs", "t": T0, "run_tree": [], "holders": [STALE_HOLDER]},
        {
            "ev": "anomalies",
            "items": [
                {
                    "kind": "phantom_utilization",
                    "gpu": 0,
                    "pid": None,
                    "thread": None,
                    "message": "GPU 0 reports 100% utilization with 0 MiB used and no process "
                    "holding it: a stuck context or a driver fault; try nvidia-smi -r",
                },
                {
                    "kind": "stale_holder",
                    "gpu": 1,
                    "pid": 901,
                    "thread": None,
                    "message": "pid 901 (alice, python old_train.py) holds GPU 1 with 30000 MiB outside the run",
                },
            ],
        },
    ]
    app = app_with(events)

    async def feed_and_focus(pilot: Any) -> None:
        await app.snapshot_feed(pilot)  # type: ignore[attr-defined]
        for _ in range(100):  # a failure raised in here would hang the snapshot run, so no pytest.fail
            if app.query("AnomalyBadge"):
                break
            await pilot.pause()
        app.query_one("AnomalyBadge").focus()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=feed_and_focus)


def test_dead_drafter_thread(snap_compare: Callable[..., bool]) -> None:
    threads = ["drafter-0", "drafter-1", "drafter-2"]
    events = [e for e in healthy_events(tuple(threads)) if e.get("ev") != "engine"]
    steps = engine_events(threads, 20)
    dead_after = [e for e in steps if not (e["event"]["thread"] == "drafter-1" and e["event"]["step"] > 12)]
    events += dead_after
    events += [
        {
            "ev": "engine",
            "offset": 999_999,
            "event": {
                "t": T0 + 23,
                "kind": "thread_error",
                "thread": "drafter-1",
                "exc_type": "RuntimeError",
                "policy": "stop",
                "message": "CUDA error: an illegal memory access was encountered",
                "traceback": "Traceback (most recent call last): ...",
            },
        },
        {
            "ev": "anomalies",
            "items": [
                {
                    "kind": "dead_thread",
                    "thread": "drafter-1",
                    "gpu": None,
                    "pid": None,
                    "message": "drafter-1 died at step 12: RuntimeError: CUDA error",
                }
            ],
        },
    ]
    logs, _ = log_events(
        [
            "Exception in thread drafter-1:",
            "Traceback (most recent call last):",
            "RuntimeError: CUDA error: an illegal memory access was encountered",
        ],
        start=log_end(events),
    )
    events += logs
    assert compare(snap_compare, app_with(events))


def test_reconnecting(snap_compare: Callable[..., bool]) -> None:
    session = RecordingSession()
    events = [
        *healthy_events(),
        {"ev": "connection", "state": "reconnecting", "detail": "link lost: connection reset", "attempt": 3},
    ]
    session.state = "reconnecting"
    assert compare(snap_compare, app_with(events, session))


def test_disconnected(snap_compare: Callable[..., bool]) -> None:
    session = RecordingSession()
    events = [
        *healthy_events(),
        {"ev": "connection", "state": "disconnected", "detail": "gave up after 8 attempts", "attempt": 8},
    ]
    session.state = "disconnected"
    assert compare(snap_compare, app_with(events, session))
