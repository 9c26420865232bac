"""The compile guard holds for a whole run: a recompile in one thread never overlaps another thread's
compiled call, and guard checks that fail only because threads share a compiled function are retried alone
instead of compiling a graph. Dynamo with the aot_eager backend traces with FX like inductor does, so the
race the H200 run died of (FX's process-wide tracing flag seen by another thread's compiled call) happens
on the CPU too."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from support.waiting import wait_until

from engine.protocol import CompileEvent
from engine.trainer.threads import compile as guard

READER_CALLS_MIN = 200  # calls each reader makes at least, so they run through the other thread's compiles


def deep(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Long enough to trace that the other threads' calls land inside the trace."""
    for _ in range(40):
        x = torch.sin(x) * a + b
    return x


@pytest.fixture()
def fresh_dynamo() -> Any:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.compiler.set_stance("default")


def test_a_forced_recompile_in_one_thread_never_runs_beside_compiled_calls_of_the_others(
    fresh_dynamo: None,
) -> None:
    fn = guard.GuardedFunction(deep, compiled=True, name="ttt_step", backend="aot_eager")
    events: list[CompileEvent] = []
    fn.listeners.append(events.append)
    errors: list[tuple[str, BaseException]] = []
    calls: dict[str, int] = {}
    warm = threading.Barrier(3, timeout=120)
    recompiler_done = threading.Event()
    m = torch.ones(8)

    def warm_up() -> None:
        guard.apply_dynamo_config()
        with guard.compile_guard():
            fn(torch.randn(8), m, torch.zeros(8))
        fn.mark_warm()
        warm.wait()

    def reader() -> None:
        name = threading.current_thread().name
        try:
            warm_up()
            n = 0
            while not recompiler_done.is_set() or n < READER_CALLS_MIN:
                fn(torch.randn(8), m, torch.zeros(8))
                n += 1
            calls[name] = n
        except BaseException as exc:
            errors.append((name, exc))

    def recompiler() -> None:
        name = threading.current_thread().name
        try:
            warm_up()
            for n in range(1, 4):  # new shapes: new signatures, each a graph after warm-up
                fn(torch.randn(8 + n), torch.ones(8 + n), torch.zeros(8 + n))
            fn(torch.randn(8), m, m)  # the shapes it warmed up with, but two arguments are now one tensor
        except BaseException as exc:
            errors.append((name, exc))
        finally:
            recompiler_done.set()

    threads = [threading.Thread(target=reader, name=f"drafter{i}") for i in range(2)]
    threads.append(threading.Thread(target=recompiler, name="drafter2"))
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    assert errors == [], errors
    assert all(calls[f"drafter{i}"] >= READER_CALLS_MIN for i in range(2)), calls
    # Every graph compiled after warm-up is the recompiler's and is an event; the readers never compiled.
    assert [(e.what, e.thread) for e in events] == [("recompile", "drafter2")] * 4
    assert fn.graph_count() == 5


def test_shared_lock_sets_fail_on_recompile_so_a_guard_failure_is_retried_alone(fresh_dynamo: None) -> None:
    fn = guard.GuardedFunction(deep, compiled=True, name="ttt_step", backend="eager")
    events: list[CompileEvent] = []
    fn.listeners.append(events.append)
    m = torch.ones(4)
    fn(torch.randn(4), m, torch.zeros(4))
    fn.mark_warm()
    lock = guard.compile_lock()
    # Another thread's compiled call in progress: compiling now must be refused.
    with lock.reading(), pytest.raises(RuntimeError, match="fail_on_recompile"):
        torch.compile(deep, backend="eager")(torch.randn(5), torch.ones(5), torch.zeros(5))
    assert lock.readers() == 0
    fn(torch.randn(4), m, m)  # a guard the signature does not show fails: refused shared, compiled alone
    assert [(e.what, e.graphs) for e in events] == [("recompile", 2)]
    fn(torch.randn(4), m, torch.zeros(4))  # the first graph again: guards pass, nothing compiled or retried
    assert fn.retries == 0 and fn.graph_count() == 2


def test_a_writer_waits_for_readers_and_new_readers_wait_for_a_waiting_writer() -> None:
    stances: list[str] = []
    lock = guard.CompileLock(set_stance=stances.append)
    order: list[str] = []
    reader_in = threading.Event()
    release_reader = threading.Event()

    def first_reader() -> None:
        with lock.reading():
            reader_in.set()
            release_reader.wait(30)
            order.append("reader1 out")

    def writer() -> None:
        with lock.writing():
            order.append("writer in")

    def late_reader() -> None:
        with lock.reading():
            order.append("reader2 in")

    r1 = threading.Thread(target=first_reader)
    r1.start()
    assert reader_in.wait(30)
    w = threading.Thread(target=writer)
    w.start()

    def writer_is_waiting() -> bool:
        with lock._cond:
            return lock._writers_waiting == 1

    wait_until(writer_is_waiting, timeout_s=30, what="the writer to wait for the reader")
    r2 = threading.Thread(target=late_reader)
    r2.start()
    release_reader.set()
    for t in (r1, w, r2):
        t.join(30)
    assert order == ["reader1 out", "writer in", "reader2 in"]
    assert stances == ["fail_on_recompile", "default", "fail_on_recompile", "default"]
    with lock.writing(), lock.reading(), lock.writing():  # reentrant for the writer: no deadlock
        assert lock.held_alone()
    with lock.reading(), pytest.raises(RuntimeError, match="cannot trace or compile"), lock.writing():
        pass


def test_a_thread_working_for_the_writer_calls_compiled_code_under_its_hold(fresh_dynamo: None) -> None:
    # CUDA runs a backward on autograd's own threads; with checkpointing they call the compiled step again
    # while the warming thread holds the lock alone and waits for them. Lent, they run; not lent, they wait.
    fn = guard.GuardedFunction(deep, compiled=True, name="ttt_step", backend="eager")
    m = torch.ones(4)
    fn(torch.randn(4), m, torch.zeros(4))
    done: list[str] = []

    def autograd_thread() -> None:
        fn(torch.randn(4), m, torch.zeros(4))
        done.append("recomputed")

    with guard.compile_guard():
        with guard.lending_guard():
            helper = threading.Thread(target=autograd_thread)
            helper.start()
            helper.join(60)
        assert done == ["recomputed"]
        blocked = threading.Thread(target=autograd_thread)
        blocked.start()
        lock = guard.compile_lock()
        wait_until(lambda: lock.readers_waiting() == 1, timeout_s=30, what="the unlent thread to wait for the writer")
        assert done == ["recomputed"]
    blocked.join(60)
    assert done == ["recomputed", "recomputed"]
    with pytest.raises(RuntimeError, match="only the thread holding it alone"), guard.compile_lock().lending():
        pass
