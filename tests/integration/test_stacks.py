"""`stacks` of a busy run: the engine's SIGUSR1 dump goes to its own file in the run dir, names every thread
and comes back in under a second, however fast the run logs; faulthandler answers when Python cannot run.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from support.agent import REPO_ROOT, AgentClient, launch_and_wait

from engine.supervisor import stacks as stacks_mod

pytestmark = [pytest.mark.tmux, pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux")]

# Registers the engine's handler, then logs every 50 ms from threads named as the engine names its own.
BUSY_RUN = textwrap.dedent(
    """
    import os, threading, time
    from engine import stackdump
    stackdump.install(os.environ["SPECDEC_RUN_DIR"])
    def drafter_loop():
        for i in range(100000):
            print(f"step={i} thread=drafter0 loss=1.0", flush=True)
            time.sleep(0.05)
    def target_loop():
        for i in range(100000):
            print(f"target0 produced batch {i}", flush=True)
            time.sleep(0.05)
    threading.Thread(target=drafter_loop, name="drafter0", daemon=True).start()
    threading.Thread(target=target_loop, name="target0", daemon=True).start()
    while True:
        print("main: health tick", flush=True)
        time.sleep(0.05)
    """
)
LOG_LINE = re.compile(r"^(step=\d+|target0 produced|main: health tick)", re.M)


def _stop(agent: AgentClient, run_id: str) -> None:
    agent.ok("stop", run_id=run_id, grace_s=2, release_timeout_s=1)


def test_stacks_of_a_run_logging_every_50_ms_come_back_named_in_under_a_second(agent: AgentClient) -> None:
    launched, _, _ = launch_and_wait(agent, [sys.executable, "-c", BUSY_RUN], "output", 30, cwd=str(REPO_ROOT))
    try:
        for _ in range(3):
            t0 = time.monotonic()
            res = agent.ok("stacks", timeout_s=20)
            elapsed_s = time.monotonic() - t0
            assert elapsed_s < 1.0, f"stacks took {elapsed_s:.2f} s"
            assert "named threads" in res["method"], res["method"]
            text = res["text"]
            for name in ("MainThread", "drafter0", "target0"):
                assert f"Thread {name} (" in text, text
            assert "in drafter_loop" in text and "in target_loop" in text
            assert not LOG_LINE.search(text), f"log lines mixed into the dump:\n{text}"
            assert "Thread 0x" not in text
    finally:
        _stop(agent, launched["run_id"])


def test_a_thread_holding_the_gil_gets_faulthandlers_dump_soon_after_the_named_dump_wait(agent: AgentClient) -> None:
    # The main thread sits in one long C call (sum over a range holds the GIL): no Python handler can run.
    busy_main = 'while True:\n    print("main: health tick", flush=True)'
    script = BUSY_RUN.replace(busy_main, "print('up', flush=True)\nwhile True:\n    sum(range(10**12))")
    launched, _, _ = launch_and_wait(agent, [sys.executable, "-c", script], "output", 30, cwd=str(REPO_ROOT))
    try:
        t0 = time.monotonic()
        res = agent.ok("stacks", timeout_s=20)
        elapsed_s = time.monotonic() - t0
        assert elapsed_s < stacks_mod.NAMED_DUMP_WAIT_S + 1.5, f"stacks took {elapsed_s:.2f} s"
        assert "faulthandler, threads unnamed" in res["method"] and "GIL" in res["method"], res["method"]
        assert "most recent call first" in res["text"] and "<module>" in res["text"], res["text"]
        assert not LOG_LINE.search(res["text"])
    finally:
        _stop(agent, launched["run_id"])


def test_an_unwritable_run_dir_leaves_dumps_on_stderr_and_the_run_going(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the run dir should be")
    script = (
        "import os, signal, sys\nfrom engine import stackdump\n"
        "print(stackdump.install(sys.argv[1]), flush=True)\nos.kill(os.getpid(), signal.SIGUSR1)\nprint('alive')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(blocker / "run")], capture_output=True, text=True, timeout=30, cwd=REPO_ROOT
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "alive"]
    assert "stack dumps go to stderr" in done.stderr and "Thread MainThread (" in done.stderr
    assert "most recent call last" in done.stderr  # the named dump; faulthandler's walk is not on SIGUSR1
