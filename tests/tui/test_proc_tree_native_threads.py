"""One row per engine thread: the native threads a worker starts (CUDA, autograd, compile workers) inherit its
OS name, and the process pane groups them under its row with a count instead of repeating the worker.

Real threads: a child process names three workers and a target as the engine does (prctl), and each drafter
starts low-level threads (``_thread.start_new_thread``: no Python-level name, so they keep the inherited
comm, as native threads do). The agent's process table reads them from /proc like for any run."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from support.agent import REPO_ROOT
from support.waiting import wait_until
from textual.app import App, ComposeResult

from engine.host.procs import threads_of
from engine.protocol import ProcInfo, ProcsEvent, decode_engine_event
from tui.dashboard.widgets.proc_tree import ProcTree, ThreadHealthModel, thread_rows

NATIVE_PER_DRAFTER = 7

CHILD = textwrap.dedent(
    f"""
    import _thread, sys, threading
    from engine.trainer.threads.health import name_os_thread
    hold = threading.Event()
    def native():
        hold.wait()
    def worker(name, natives):
        name_os_thread(name)
        for _ in range(natives):
            _thread.start_new_thread(native, ())
        hold.wait()
    for name, natives in (("target0", 0), ("drafter0", {NATIVE_PER_DRAFTER}), ("drafter1", {NATIVE_PER_DRAFTER}),
                          ("drafter2", {NATIVE_PER_DRAFTER})):
        threading.Thread(target=worker, args=(name, natives), name=name, daemon=True).start()
    print("up", flush=True)
    sys.stdin.read()
    """
)


class _Pane(App[None]):
    def __init__(self, health: ThreadHealthModel) -> None:
        super().__init__()
        self.health = health

    def compose(self) -> ComposeResult:
        yield ProcTree(self.health, clock=lambda: 100.0, id="procs")


async def test_native_threads_named_like_a_worker_collapse_into_its_row() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"

        def named_and_started() -> bool:
            names = [t.name for t in threads_of(child.pid)]
            drafters = all(names.count(f"drafter{i}") == 1 + NATIVE_PER_DRAFTER for i in range(3))
            return drafters and "target0" in names

        wait_until(named_and_started, timeout_s=20, what=f"the named workers and their threads in pid {child.pid}")
        threads = threads_of(child.pid)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(20)
    names = [t.name for t in threads]
    assert names.count("drafter1") == 1 + NATIVE_PER_DRAFTER  # what the pane repeated, one row each
    rows = {row.name: row.native for row in thread_rows(threads)}
    assert {n: rows[n] for n in ("target0", "drafter0", "drafter1", "drafter2")} == {
        "target0": 0,
        "drafter0": NATIVE_PER_DRAFTER,
        "drafter1": NATIVE_PER_DRAFTER,
        "drafter2": NATIVE_PER_DRAFTER,
    }

    health = ThreadHealthModel()
    for name in ("target0", "drafter0", "drafter1", "drafter2"):
        beat = {"t": 99.5, "kind": "heartbeat", "thread": name, "state": "training", "step": 150}
        health.add_engine_event(decode_engine_event(beat))
    cmd = "python3 -m engine.trainer --preset cpu-demo"
    proc = ProcInfo(child.pid, 1, "root", cmd, None, None, None, None, threads)
    app = _Pane(health)
    async with app.run_test(size=(200, 50)) as pilot:
        pane = app.query_one(ProcTree)
        pane.update_procs(ProcsEvent(t=100.0, run_tree=[proc], holders=[]))
        await pilot.pause()
        text = pane.render().plain  # type: ignore[union-attr]
    lines = text.splitlines()
    for name in ("drafter0", "drafter1", "drafter2"):
        rows_of = [line for line in lines if f"{name} " in line]
        assert len(rows_of) == 1, text
        assert f"+{NATIVE_PER_DRAFTER} native" in rows_of[0] and "training step 150" in rows_of[0], rows_of
    assert sum("target0" in line for line in lines) == 1
    # The pid line, four engine threads and the stale list fit a 50-row terminal's pane with room to spare.
    assert lines[1].strip().startswith(str(child.pid)) and "stale GPU holders" in text
    assert len(lines) <= 10, text


POOL = textwrap.dedent(
    """
    import subprocess, sys, threading
    from engine.trainer.threads.health import name_os_thread
    hold = threading.Event()
    def worker(name):
        name_os_thread(name)
        hold.wait()
    for name in ("target0", "drafter0"):
        threading.Thread(target=worker, args=(name,), name=name, daemon=True).start()
    # A compile-worker pool as inductor starts one: a pool process and identical workers under it.
    pool = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys; ws = [subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'],"
        " stdin=subprocess.PIPE) for _ in range(6)]; print('up', flush=True); sys.stdin.read()"
    )], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert pool.stdout.readline().strip() == "up"
    print("up", flush=True)
    sys.stdin.read()
    """
)


async def test_a_pool_of_identical_worker_processes_is_one_row_and_native_threads_stay_out() -> None:
    """On the H200 inductor's compile-worker pool (a pool process and 16+ identical workers) pushed the stale
    list off a 50-row pane: the workers fold into one row with a count, summed cpu and rss; the pool process's
    own CUDA thread is not listed once heartbeats name the engine's threads; long paths are cut to their tail."""
    from engine.host.procs import all_stats, proc_info, tree_pids

    child = subprocess.Popen(
        [sys.executable, "-c", POOL], cwd=REPO_ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"

        def whole_tree() -> list[ProcInfo] | None:
            stats = all_stats()
            tree = [proc_info(stats[p]) for p in tree_pids(child.pid, stats) if p in stats]
            named = {t.name for p in tree for t in p.threads}
            return tree if len(tree) == 8 and {"target0", "drafter0"} <= named else None

        tree = wait_until(whole_tree, timeout_s=20, what=f"pid {child.pid}, its pool and six workers")
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(20)
    health = ThreadHealthModel()
    for name in ("target0", "drafter0"):
        beat = {"t": 99.5, "kind": "heartbeat", "thread": name, "state": "training", "step": 7}
        health.add_engine_event(decode_engine_event(beat))
    app = _Pane(health)
    async with app.run_test(size=(200, 50)) as pilot:
        pane = app.query_one(ProcTree)
        pane.update_procs(ProcsEvent(t=100.0, run_tree=tree, holders=[]))
        await pilot.pause()
        text = pane.render().plain  # type: ignore[union-attr]
    lines = text.splitlines()
    workers = [p for p in tree if p.ppid not in (child.pid, 1) and p.pid != child.pid]
    assert len(workers) == 6
    folded = [line for line in lines if "×6" in line]
    assert len(folded) == 1 and f"{min(w.pid for w in workers)} ×6 python" in folded[0], text
    assert not any(str(w.pid) in line for w in workers for line in lines if line is not folded[0]), text
    assert sum("drafter0" in line for line in lines) == 1 and sum("target0" in line for line in lines) == 1
    assert len(lines) <= 8, text  # run, engine pid, 2 threads, pool, workers, stale title, none
    assert lines[1].strip().startswith(f"{child.pid} python") and "/" not in lines[1].split()[1], text


def test_short_cmd_keeps_what_runs() -> None:
    from tui.dashboard.widgets.proc_tree import short_cmd

    site = "/opt/torch/.venv/lib/python3.12/site-packages"
    long = f"/opt/torch/.venv/bin/python3 {site}/torch/_inductor/compile_worker/__main__.py --workers=16"
    assert short_cmd(long) == "python3 …/compile_worker/__main__.py --workers=16"
    assert short_cmd("python3 -m engine.trainer --preset cpu-demo") == "python3 -m engine.trainer --preset cpu-demo"
    assert short_cmd("/bin/sh -c /tmp/x") == "sh -c /tmp/x"


async def test_threads_of_a_run_that_ended_read_ended_not_silent() -> None:
    """After the run exits its threads stop beating: that is the end of the run, not a warning."""
    health = ThreadHealthModel()
    beat = {"t": 10.0, "kind": "heartbeat", "thread": "drafter0", "state": "training", "step": 200, "tok_s": 2900.0}
    health.add_engine_event(decode_engine_event(beat))
    app = _Pane(health)  # the pane's clock reads 100.0: the last beat is 90 s old
    async with app.run_test(size=(120, 20)) as pilot:
        pane = app.query_one(ProcTree)
        pane.update_procs(ProcsEvent(t=100.0, run_tree=[], holders=[]))
        await pilot.pause()
        running = pane.render().plain  # type: ignore[union-attr]
        health.run_over = True
        pane.refresh()
        await pilot.pause()
        ended = pane.render().plain  # type: ignore[union-attr]
    assert "drafter0    SILENT step 200 hb 90.0s" in running, running
    row = next(line for line in ended.splitlines() if "drafter0" in line)
    assert row.strip() == "drafter0    ended step 200", ended
