"""Anomaly rules as pure functions of a GPU sample, holders, the run tree and engine events."""

from __future__ import annotations

import os
from typing import Any

from engine.agent.anomalies import (
    THREADS_KEPT,
    EngineState,
    dead_threads,
    engine_anomalies,
    gpu_anomalies,
    stall_threshold_s,
    stalled_run,
)
from engine.protocol import (
    Anomaly,
    GpuInfo,
    HeartbeatEvent,
    HolderInfo,
    StepEvent,
    ThreadErrorEvent,
    decode_engine_event,
    decode_engine_line,
)


def gpu(index: int, util: float | None, mem: float | None, holder_pids: list[int] | None = None) -> GpuInfo:
    return GpuInfo(
        index=index,
        name="H200",
        uuid=f"GPU-{index}",
        util_pct=util,
        mem_used_mib=mem,
        mem_total_mib=143771.0,
        holder_pids=holder_pids or [],
    )


def holder(pid: int, gpus: list[int], resolved: bool = True, **kw: object) -> HolderInfo:
    base: dict[str, object] = {"user": "ml", "cmd": "python3 train.py", "state": "sleeping", "create_time": 1.0}
    if not resolved:
        base = {}
    base.update(kw)
    return HolderInfo(pid=pid, resolved=resolved, gpus=gpus, **base)  # type: ignore[arg-type]


def kinds(items: list[Anomaly]) -> list[tuple[str, int | None, int | None]]:
    return [(a.kind, a.gpu, a.pid) for a in items]


def test_healthy_run_has_no_anomaly() -> None:
    gpus = [gpu(0, 97, 80000, [100]), gpu(1, 0, 0)]
    holders = [holder(100, [0], in_run=True)]
    assert gpu_anomalies(gpus, holders, {100}, run_active=True) == []


def test_phantom_utilization_busy_empty_and_unheld() -> None:
    items = gpu_anomalies([gpu(3, 100, 0)], [], set(), run_active=False)
    assert kinds(items) == [("phantom_utilization", 3, None)]
    assert "100%" in items[0].message and "0 MiB" in items[0].message


def test_phantom_needs_all_three_conditions() -> None:
    assert gpu_anomalies([gpu(0, 89, 0)], [], set(), False) == []  # not busy enough
    assert kinds(gpu_anomalies([gpu(0, 95, 500)], [], set(), False)) == [("orphan_memory", 0, None)]  # has memory
    held = [holder(7, [0])]
    assert kinds(gpu_anomalies([gpu(0, 95, 0)], held, {7}, True)) == []  # someone holds it
    assert gpu_anomalies([gpu(0, 95, 0, [12345])], [], set(), False) == []  # NVML sees a process
    assert gpu_anomalies([gpu(0, None, None)], [], set(), False) == []  # unsupported fields: no verdict


def test_orphan_memory_without_any_holder() -> None:
    items = gpu_anomalies([gpu(5, 0, 40000)], [], set(), run_active=False)
    assert kinds(items) == [("orphan_memory", 5, None)]
    assert "40000 MiB" in items[0].message and "no live process" in items[0].message


def test_orphan_memory_held_by_a_pid_this_namespace_cannot_see() -> None:
    items = gpu_anomalies([gpu(2, 50, 9000, [777])], [holder(777, [2], resolved=False)], set(), True)
    assert kinds(items) == [("orphan_memory", 2, None)]
    assert "777" in items[0].message and "cannot see" in items[0].message


def test_orphan_memory_with_a_zombie_holder() -> None:
    items = gpu_anomalies([gpu(1, 0, 9000)], [holder(55, [1], state="zombie")], set(), True)
    assert [a.kind for a in items] == ["orphan_memory"]
    assert "zombie" in items[0].message


def test_small_driver_bookkeeping_is_not_orphan_memory() -> None:
    assert gpu_anomalies([gpu(0, 0, 100)], [], set(), False) == []


def test_stale_holder_outside_the_run_tree() -> None:
    gpus = [gpu(0, 90, 70000), gpu(1, 10, 20000)]
    holders = [holder(100, [0], in_run=True), holder(200, [1], used_mib=20000.0, cmd="python3 old_run.py")]
    items = gpu_anomalies(gpus, holders, {100}, run_active=True)
    assert kinds(items) == [("stale_holder", 1, 200)]
    assert "old_run.py" in items[0].message and "not part of the current run" in items[0].message


def test_stale_holder_when_no_run_is_active() -> None:
    items = gpu_anomalies([gpu(0, 0, 5000)], [holder(300, [0])], set(), run_active=False)
    assert kinds(items) == [("stale_holder", 0, 300)]
    assert "no run is active" in items[0].message


def test_not_stale_this_agent_a_recorded_agent_ctl_only_and_unresolved() -> None:
    holders = [
        holder(os.getpid(), [0], cmd="python3 -m engine.agent.main"),
        holder(14, [0], cmd="/usr/bin/python3 -m engine.agent.main --run-root /root/.specdec"),
        holder(12, [], cmd="python3 only_ctl.py"),
        holder(13, [0], resolved=False, used_mib=100.0),
    ]
    items = gpu_anomalies([gpu(0, 0, 0)], holders, set(), run_active=False, agents={14})
    assert [a for a in items if a.kind == "stale_holder"] == []


def test_a_name_alone_makes_no_holder_a_daemon_and_no_holder_with_a_gpu_context_an_agent() -> None:
    # pid 11 is no installed nvidia-persistenced; pid 14 says it is an agent but has a GPU context (NVML lists
    # it): GPU memory it may hold, so stale whatever its command line says. pid 15, an agent of another run root
    # with no GPU context (it holds the device for NVML only), is left out: killing it would free nothing.
    agent_cmd = "/usr/bin/python3 -m engine.agent.main --run-root /root/other"
    holders = [
        holder(11, [0], cmd="/usr/bin/nvidia-persistenced --user nvidia-persistenced"),
        holder(14, [0], cmd=agent_cmd, context=True),
        holder(15, [0], cmd=agent_cmd),
    ]
    items = gpu_anomalies([gpu(0, 0, 0)], holders, set(), run_active=False)
    assert kinds([a for a in items if a.kind == "stale_holder"]) == [("stale_holder", 0, 11), ("stale_holder", 0, 14)]


def feed(state: EngineState, line: dict[str, Any]) -> None:
    """One line of events.jsonl, decoded as the agent decodes it, into the state."""
    state.feed(decode_engine_event(line))


def steps(state: EngineState, times: list[float], thread: str = "drafter-0") -> None:
    for i, t in enumerate(times):
        feed(state, {"kind": "step", "t": t, "thread": thread, "step": i + 1})


def test_stall_threshold_is_k_times_median_clamped() -> None:
    assert stall_threshold_s([]) is None
    assert stall_threshold_s([10.0]) is None
    assert stall_threshold_s([0.0, 20.0, 40.0, 60.0], k=5, floor_s=60, cap_s=1800) == 100.0
    assert stall_threshold_s([0.0, 1.0, 2.0], k=5, floor_s=60, cap_s=1800) == 60.0  # floor
    assert stall_threshold_s([0.0, 1000.0, 2000.0], k=5, floor_s=60, cap_s=1800) == 1800.0  # cap


def test_stalled_run_after_k_median_steps() -> None:
    st = EngineState()
    steps(st, [100.0, 102.0, 104.0, 106.0])  # median 2 s, k=5 -> 10 s (floor lowered for the test)
    assert stalled_run(st, now=115.0, running=True, k=5, floor_s=1, cap_s=100) is None
    item = stalled_run(st, now=117.0, running=True, k=5, floor_s=1, cap_s=100)
    assert item is not None and item.kind == "stalled_run"
    assert "step 4" in item.message and "11 s" in item.message
    assert stalled_run(st, now=117.0, running=False, k=5, floor_s=1, cap_s=100) is None  # not running: no stall


def test_several_threads_reporting_one_step_count_once() -> None:
    st = EngineState()
    for t, step in [(0.0, 1), (0.1, 1), (10.0, 2), (10.1, 2), (20.0, 3)]:
        feed(st, {"kind": "step", "t": t, "thread": "x", "step": step})
    assert list(st.step_times) == [0.0, 10.0, 20.0]
    assert stall_threshold_s(st.step_times, k=3, floor_s=1, cap_s=1000) == 30.0


def test_run_end_is_never_a_stall() -> None:
    st = EngineState()
    steps(st, [0.0, 1.0, 2.0])
    feed(st, {"kind": "run_end", "t": 3.0, "ok": True, "reason": "done", "step": 3})
    assert stalled_run(st, now=10_000.0, running=True) is None


def test_dead_thread_from_thread_error() -> None:
    st = EngineState()
    feed(
        st,
        {
            "kind": "thread_error",
            "t": 5.0,
            "thread": "drafter-1",
            "exc_type": "RuntimeError",
            "message": "CUDA out of memory",
            "traceback": "...",
            "policy": "stop",
        },
    )
    items = dead_threads(st, now=6.0, running=True)
    assert [(a.kind, a.thread) for a in items] == [("dead_thread", "drafter-1")]
    assert "RuntimeError" in items[0].message and "out of memory" in items[0].message


def test_dead_thread_from_silent_heartbeats_and_error_state() -> None:
    st = EngineState()
    feed(st, {"kind": "heartbeat", "t": 100.0, "thread": "producer-0", "state": "training", "step": 9})
    feed(st, {"kind": "heartbeat", "t": 195.0, "thread": "drafter-0", "state": "training", "step": 9})
    feed(st, {"kind": "heartbeat", "t": 190.0, "thread": "drafter-1", "state": "error", "last_exception": "boom"})
    feed(st, {"kind": "heartbeat", "t": 10.0, "thread": "drafter-2", "state": "stopped", "step": 9})
    items = dead_threads(st, now=200.0, running=True, heartbeat_timeout_s=60.0)
    assert sorted(a.thread or "" for a in items) == ["drafter-1", "producer-0"]
    silent = next(a for a in items if a.thread == "producer-0")
    assert "100 s" in silent.message
    assert dead_threads(st, now=200.0, running=False, heartbeat_timeout_s=60.0) == []


def test_engine_anomalies_combines_both_with_limits() -> None:
    st = EngineState()
    steps(st, [0.0, 1.0, 2.0])
    feed(st, {"kind": "heartbeat", "t": 2.0, "thread": "drafter-0", "state": "training", "step": 3})
    items = engine_anomalies(st, 50.0, True, k=5, floor_s=10, cap_s=20, heartbeat_timeout_s=30)
    assert sorted(a.kind for a in items) == ["dead_thread", "stalled_run"]
    assert engine_anomalies(st, 5.0, True, k=5, floor_s=10, cap_s=20, heartbeat_timeout_s=30) == []


def test_events_without_time_are_ignored() -> None:
    st = EngineState()
    feed(st, {"kind": "step", "step": 1})
    feed(st, {"kind": "heartbeat", "thread": "x"})
    assert st.last_step is None and st.heartbeats == {}


def test_an_engine_line_of_the_wrong_shape_is_no_event_to_the_anomalies() -> None:
    assert decode_engine_line(b'{"kind": "step", "t": 1.0, "step": 3}') == StepEvent(step=3, t=1.0)
    assert decode_engine_line(b'{"kind": "step", "t": 1.0, "step": "three"}') is None
    assert decode_engine_line(b'{"kind": "heartbeat", "t": 1.0}') is None  # no thread
    assert decode_engine_line(b'{"kind": "nonsense", "t": 1.0}') is None
    assert decode_engine_line(b'{"kind": "step", "t": 1.0, "ste') is None  # torn


def test_engine_state_keeps_at_most_threads_kept_threads_of_each_table() -> None:
    state = EngineState()
    for i in range(THREADS_KEPT + 50):
        state.feed(HeartbeatEvent(thread=f"t{i}", t=1.0))
        state.feed(ThreadErrorEvent(thread=f"t{i}", t=1.0))
    state.feed(HeartbeatEvent(thread="t0", state="waiting", t=2.0))  # a kept thread still updates
    assert len(state.heartbeats) == len(state.thread_errors) == THREADS_KEPT and state.dropped == 100
    assert state.heartbeats["t0"].state == "waiting"
