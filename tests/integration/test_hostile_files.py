"""A huge events.jsonl costs status and the agent a bounded time and memory, not one growing with the file.

Real parts: a running run on disk (its job a live process) whose events.jsonl is 64 MiB of valid event lines (or one
line without end), ``python3 -m tui status local --json`` as a subprocess with the agent it starts, and a subscribed
agent (``engine.agent.main``). Peak memory is each process's VmHWM. The file is big enough that reading it whole
(what status did before) takes several seconds and well over a hundred MiB; the bounds leave room for a busy machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import hostile
from support.agent import REPO_ROOT, AgentClient, checkout_env
from support.waiting import wait_until

EVENTS_MIB = 64
STATUS_WITHIN_S = 5.0  # reading all 64 MiB took 7-8 s on a 2-core machine; the head and the tail take about 1 s
AGENT_PEAK_MIB = 100.0  # an idle agent is about 50 MiB; one that held the file's lines passed 160 MiB
STREAM_LAST_STEP_WITHIN_S = 10.0


@pytest.fixture
def huge_run(tmp_path: Path) -> Iterator[hostile.HugeRun]:
    run = hostile.running_run(tmp_path / "run-root")
    yield run
    run.close()


def _status(run_root: Path) -> tuple[dict[str, object], float, hostile.PeakWatch]:
    argv = [sys.executable, "-m", "tui", "status", "local", "--json", "--simulate-gpus", "2", "--run-root"]
    t0 = time.monotonic()
    proc = subprocess.Popen([*argv, str(run_root)], stdout=subprocess.PIPE, cwd=REPO_ROOT, env=checkout_env())
    watch = hostile.PeakWatch(proc.pid).start()
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        watch.stop()
    elapsed_s = time.monotonic() - t0
    assert proc.returncode == 0
    run = json.loads(out)["run"]
    assert isinstance(run, dict)
    return run, elapsed_s, watch


def test_status_of_a_run_with_64_mib_of_events_answers_from_its_tail_in_bounded_time_and_memory(
    huge_run: hostile.HugeRun,
) -> None:
    last_step = hostile.write_event_lines(huge_run.events, EVENTS_MIB << 20)
    run, elapsed_s, watch = _status(huge_run.run_root)
    agent_mib = watch.peak_of("engine.agent.main")
    assert agent_mib is not None, watch.names
    assert elapsed_s <= STATUS_WITHIN_S and agent_mib <= AGENT_PEAK_MIB, (elapsed_s, agent_mib)
    # The newest state, at once, and the middle it did not read said so.
    assert (run["state"], run["stage"], run["last_step"]) == ("running", "training", last_step)
    unread = run["events_unread_bytes"]
    assert isinstance(unread, int) and EVENTS_MIB << 19 < unread < huge_run.events.stat().st_size


def test_status_of_a_run_whose_64_mib_events_file_has_no_newline_is_bounded(huge_run: hostile.HugeRun) -> None:
    hostile.write_line_without_end(huge_run.events, EVENTS_MIB << 20)
    run, elapsed_s, watch = _status(huge_run.run_root)
    agent_mib = watch.peak_of("engine.agent.main")
    assert agent_mib is not None, watch.names
    assert elapsed_s <= STATUS_WITHIN_S and agent_mib <= AGENT_PEAK_MIB, (elapsed_s, agent_mib)
    assert run["state"] == "running" and run["events_unread_bytes"] == EVENTS_MIB << 20


def test_a_subscribed_agent_streams_the_newest_events_of_64_mib_first_and_stays_bounded(
    huge_run: hostile.HugeRun,
) -> None:
    last_step = hostile.write_event_lines(huge_run.events, EVENTS_MIB << 20)
    agent = AgentClient(huge_run.run_root, simulate_gpus=2)
    try:
        agent.ok("subscribe")

        def newest_step() -> bool:
            return any(
                e["ev"] == "engine" and e["event"].get("kind") == "step" and e["event"].get("step") == last_step
                for e in reversed(agent.events)
            )

        wait_until(newest_step, STREAM_LAST_STEP_WITHIN_S, "the run's last step on the stream")
        warning = agent.next_event(lambda e: e["ev"] == "warning" and "not sent" in e["message"], what="a warning")
        assert "events.jsonl of " + hostile.RUN_ID in warning["message"]
        engine = [e for e in agent.events if e["ev"] == "engine"]
        assert engine[0]["event"]["kind"] == "stage" and engine[0]["event"]["stage"] == "distributed"  # the head
        assert len(engine) < 30_000  # not the file's 350,000 lines
        peak = hostile.vm_hwm_mib(agent.proc.pid)
        assert peak is not None and peak <= AGENT_PEAK_MIB, peak
    finally:
        assert agent.close() == 0


LOG_MIB = 64


def test_a_new_subscriber_gets_the_last_mib_of_a_64_mib_log_then_what_is_appended(huge_run: hostile.HugeRun) -> None:
    """The dashboard subscribes with no position in output.log: a long run's whole log (hundreds of MiB over SSH)
    used to come first, the newest line last. It now gets the log's last MiB, from a line start, and a warning that
    says what was not sent; lines appended afterwards follow as always."""
    log = huge_run.run_dir / "output.log"
    line = b"step=%08d thread=drafter0 loss=1.2345 acc0=0.5000 tok/s=81234\n"
    width = len(line % 0)
    with log.open("wb") as fh:
        for block in range((LOG_MIB << 20) // (width * 10_000)):
            fh.write(b"".join(line % (block * 10_000 + i) for i in range(10_000)))
    size = log.stat().st_size
    skipped_mib = round((size - (1 << 20)) / (1 << 20))
    agent = AgentClient(huge_run.run_root, simulate_gpus=2)
    try:
        agent.ok("subscribe")
        warning = agent.next_event(lambda e: e["ev"] == "warning" and "output.log" in e["message"], what="a warning")
        assert f"output.log of {hostile.RUN_ID}: its first {skipped_mib} MiB not sent" in warning["message"], warning
        logs = [e for e in agent.events if e["ev"] == "log"]
        first = logs[0]
        assert size - (1 << 20) <= first["offset"] <= size - (1 << 20) + width, (first["offset"], size)
        sent = sum(len(e["data"]) for e in logs)
        assert sent <= (1 << 20) + width, sent
        assert first["data"].startswith("step="), first["data"][:40]  # a whole line, not the middle of one
        with log.open("ab") as fh:
            fh.write(b"step=99999999 thread=drafter0 the newest line\n")
        agent.next_event(lambda e: e["ev"] == "log" and "the newest line" in e["data"], what="the appended line")
    finally:
        assert agent.close() == 0
