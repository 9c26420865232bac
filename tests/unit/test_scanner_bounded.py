"""The scan of a huge events file is bounded: its head and its newest lines are read, the middle is counted as
unread, and the thread errors it keeps are capped."""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine import protocol
from engine.host import procs
from engine.supervisor import records
from engine.supervisor.records import LaunchRecord, scanner
from tui.cli.monitor import format_run


def _run_dir(tmp_path: Path) -> tuple[Path, LaunchRecord]:
    rd = tmp_path / "runs" / "r1"
    rd.mkdir(parents=True)
    launch = LaunchRecord(
        run_id="r1",
        command=["job"],
        wrapper_pid=os.getpid(),
        boot_id=procs.read_boot_id(),
        started_at=1.0,
        job_pid=os.getpid(),
        job_started_at=2.0,
    )
    records.write_json_atomic(rd / records.LAUNCH_JSON, launch.to_json())
    return rd, launch


def _line(**ev: object) -> bytes:
    return json.dumps(ev).encode() + b"\n"


def _steps(first: int, count: int) -> bytes:
    beat = _line(kind="heartbeat", thread="producer", state="training", queue_depth=3, t=5.0)
    return b"".join(
        _line(kind="step", step=s, thread="drafter0", loss=[2.0], t=10.0 + s) + beat * 4
        for s in range(first, first + count)
    )


def test_a_huge_events_file_is_read_at_its_head_and_its_end_and_the_middle_is_counted(tmp_path: Path) -> None:
    rd, launch = _run_dir(tmp_path)
    head = _line(kind="stage", stage="distributed", pid=4242, local_world_size=1, rank=None) + _steps(0, 3)
    middle = _steps(3, 60_000)
    tail = _line(kind="stage", stage="training") + _steps(60_003, 2)
    data = head + middle + tail
    assert len(data) > 2 * (scanner.EVENTS_HEAD_BYTES + scanner.EVENTS_TAIL_BYTES)
    (rd / records.EVENTS_JSONL).write_bytes(data)
    state = scanner.new_scanner(rd, launch).poll()
    assert state.last_step == 60_004 and state.stage == "training"  # the newest lines, in the first poll
    assert state.ranks[None].pid == 4242 and state.first_step_t == 10.0  # facts of the head
    # What was read: the head's whole lines and the tail window's lines; the rest is unread, counted exactly.
    head_read = data[: scanner.EVENTS_HEAD_BYTES].rfind(b"\n") + 1
    tail_from = data.index(b"\n", len(data) - scanner.EVENTS_TAIL_BYTES - 1) + 1
    assert state.skipped_event_bytes == tail_from - head_read > 0
    info = records.read_run(rd, procs.read_boot_id())
    assert info.events_unread_bytes == tail_from - head_read and info.last_step == 60_004


def test_an_events_file_of_normal_size_is_read_whole_and_nothing_is_counted_unread(tmp_path: Path) -> None:
    rd, launch = _run_dir(tmp_path)
    (rd / records.EVENTS_JSONL).write_bytes(_line(kind="stage", stage="training") + _steps(0, 500))
    state = scanner.new_scanner(rd, launch).poll()
    assert (state.last_step, state.stage, state.skipped_event_bytes) == (499, "training", 0)
    assert records.read_run(rd, procs.read_boot_id()).events_unread_bytes == 0


def test_a_gigantic_line_without_end_costs_one_window_and_the_lines_after_it_are_read(tmp_path: Path) -> None:
    rd, launch = _run_dir(tmp_path)
    events = rd / records.EVENTS_JSONL
    size = 3 * (scanner.EVENTS_HEAD_BYTES + scanner.EVENTS_TAIL_BYTES)
    with events.open("wb") as fh:
        fh.write(_line(kind="stage", stage="data"))
        fh.truncate(size)  # one line of NULs, no end
    sc = scanner.new_scanner(rd, launch)
    state = sc.poll()
    assert sc._ev[records.EVENTS_JSONL].position == size and sc._ev[records.EVENTS_JSONL].carry == b""
    assert state.stage == "data" and state.skipped_event_bytes == size - len(_line(kind="stage", stage="data"))
    with events.open("ab") as fh:
        fh.write(b"\n" + _line(kind="step", step=7, t=1.0))
    assert sc.poll().last_step == 7


def test_thread_errors_kept_are_capped_first_ones_and_newest_with_the_dropped_counted(tmp_path: Path) -> None:
    rd, launch = _run_dir(tmp_path)
    n = 500
    (rd / records.EVENTS_JSONL).write_bytes(
        b"".join(_line(kind="thread_error", thread=f"t{i}", exc_type="E", message=str(i)) for i in range(n))
    )
    state = scanner.new_scanner(rd, launch).poll()
    kept = [int(e.message) for e in state.thread_errors]
    first = scanner.THREAD_ERRORS_FIRST_KEPT
    assert len(kept) == scanner.THREAD_ERRORS_KEPT and state.dropped_thread_errors == n - scanner.THREAD_ERRORS_KEPT
    assert kept == list(range(first)) + list(range(n - scanner.THREAD_ERRORS_KEPT + first, n))
    assert len(state.ranks[None].thread_errors) == scanner.THREAD_ERRORS_KEPT
    assert records.root_cause(state) == "engine thread t0: E: 0"  # the first error is still the root cause


def test_events_naming_ever_new_ranks_keep_at_most_ranks_kept_states(tmp_path: Path) -> None:
    rd, launch = _run_dir(tmp_path)
    n = scanner.RANKS_KEPT + 300
    (rd / records.EVENTS_JSONL).write_bytes(b"".join(_line(kind="stage", stage="data", rank=r) for r in range(n)))
    state = scanner.new_scanner(rd, launch).poll()
    assert len(state.ranks) == scanner.RANKS_KEPT and state.dropped_rank_events == 300
    assert state.stage == "data"


def test_status_text_says_when_the_middle_of_the_events_was_not_read_and_only_then() -> None:
    run = protocol.RunInfo(run_id="r1", run_dir="/r/r1", state="running", last_step=7)
    assert not any("not read" in line for line in format_run(run))
    run.events_unread_bytes = 3 << 20
    assert "  events  3.0 MiB in the middle of its events not read (huge)" in format_run(run)


def test_the_first_look_at_a_huge_log_of_a_running_run_reads_its_end_where_the_latest_step_is(tmp_path: Path) -> None:
    rd, launch = _run_dir(tmp_path)
    launch.step_pattern = r"step=\d+"
    log = rd / records.OUTPUT_LOG
    lines = [b"step=%d loss=2.0 a line of a training log\n" % i for i in range(500_000)]
    log.write_bytes(b"".join(lines))
    assert log.stat().st_size > scanner.RunScanner.CATCH_UP_MAX_BYTES
    state = scanner.new_scanner(rd, launch).poll()
    assert state.log_last_step == 499_999 and state.skipped_log_bytes > 0
    # A scanner that follows the log as it grows (the wrapper's) reads every byte.
    follower = scanner.new_scanner(rd, launch)
    log.write_bytes(b"")
    for i in range(0, 500_000, 50_000):
        with log.open("ab") as fh:
            fh.write(b"".join(lines[i : i + 50_000]))
        state = follower.poll()
    assert state.log_last_step == 499_999 and state.skipped_log_bytes == 0


def test_a_run_dir_with_thousands_of_rank_events_files_has_only_the_first_followed(tmp_path: Path) -> None:
    rd, launch = _run_dir(tmp_path)
    for r in range(1, 2001):
        (rd / f"events.rank{r}.jsonl").write_bytes(_line(kind="stage", stage="data", rank=r))
    sc = scanner.new_scanner(rd, launch)
    state = sc.poll()
    assert len(sc._ev) == 1 + records.RANK_EVENTS_FILES_MAX and len(state.ranks) == records.RANK_EVENTS_FILES_MAX
    assert sorted(state.ranks) == list(range(1, records.RANK_EVENTS_FILES_MAX + 1))  # the lowest ranks
