"""Run records on disk as typed dataclasses: the same keys written back, wrong types refused, one run_pids."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from engine.host import procs
from engine.supervisor import records
from engine.supervisor.records import ExitRecord, LaunchRecord, SubmittedRecord


def test_a_launch_record_reads_back_the_keys_it_wrote_and_keeps_unknown_ones() -> None:
    doc = {
        "run_id": "r1",
        "command": ["python3", "-c", "pass"],
        "wrapper_pid": 7,
        "wrapper_start_ticks": 9,
        "attachable": True,
        "deadlines_s": {"output": 5},
        "output_offset_at_start": 12,
        "from_a_newer_wrapper": 1,
    }
    rec = LaunchRecord.from_json(doc)
    assert (rec.wrapper_pid, rec.job_pid, rec.deadlines_s) == (7, None, {"output": 5})
    assert rec.extra == {"from_a_newer_wrapper": 1}
    written = rec.to_json()
    assert "job_pid" not in written  # the job's ids appear once the job exists, as before
    assert LaunchRecord.from_json(written) == rec


def test_a_field_of_the_wrong_type_is_not_taken() -> None:
    rec = LaunchRecord.from_json({"job_pid": "1; kill", "job_start_ticks": True, "command": ["ok", 3]})
    assert (rec.job_pid, rec.job_start_ticks, rec.command) == (None, None, [])
    assert SubmittedRecord.from_json({"t": 5, "phase": None}).t == 5.0
    # Not taken as a field, but not lost either: written back as it was read.
    assert rec.to_json()["job_pid"] == "1; kill" and rec.to_json()["command"] == ["ok", 3]
    assert ExitRecord.from_json({"exit_code": 1.5, "signal": 9}).exit_code is None


def test_run_pids_counts_the_recorded_job_only_while_its_start_ticks_match(tmp_path: Path) -> None:
    job = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        ticks = procs.start_ticks_of(job.pid)
        assert ticks is not None
        pinned = LaunchRecord(job_pid=job.pid, job_pgid=job.pid, job_start_ticks=ticks)
        assert job.pid in records.run_pids(pinned)
        later = LaunchRecord(job_pid=job.pid, job_pgid=job.pid, job_start_ticks=ticks + 1)
        assert records.run_pids(later) == set()  # a pid whose start differs from the record is another process
    finally:
        job.kill()
        job.wait()


def test_reading_a_run_twice_without_a_cache_gives_the_same_answer_and_a_cache_keeps_one_scanner(
    tmp_path: Path,
) -> None:
    rd = tmp_path / "runs" / "r1"
    rd.mkdir(parents=True)
    launch = LaunchRecord(
        run_id="r1",
        command=["job"],
        wrapper_pid=os.getpid(),
        boot_id=procs.read_boot_id(),
        started_at=1.0,
        step_pattern=r"step=\d+",
        job_pid=os.getpid(),
        job_started_at=2.0,
    )
    records.write_json_atomic(rd / records.LAUNCH_JSON, launch.to_json())
    (rd / records.OUTPUT_LOG).write_bytes(b"step=3\n")
    first = records.read_run(rd, procs.read_boot_id())
    second = records.read_run(rd, procs.read_boot_id())
    assert first.last_step == second.last_step == 3 and first.state == "running"
    cache = records.ScannerCache()
    records.read_run(rd, procs.read_boot_id(), cache)
    read_back = records.read_launch(rd)
    assert read_back is not None
    assert cache.scanner_for(rd, read_back) is cache.scanner_for(rd, read_back)
    assert json.loads((rd / records.LAUNCH_JSON).read_text())["job_pid"] == os.getpid()


def test_an_event_line_without_end_is_skipped_and_counted_never_held_whole(tmp_path: Path) -> None:
    from engine.supervisor.records import scanner

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
    events = rd / records.EVENTS_JSONL
    with events.open("wb") as fh:
        fh.write(b'{"kind": "stage", "stage": "data"}\n')
        fh.write(b"x" * (5 * scanner.EVENT_LINE_MAX_BYTES))  # one line, no end, several bounds long
    sc = scanner.new_scanner(rd, launch)
    for _ in range(4):
        state = sc.poll(budget_bytes=2 * scanner.EVENT_LINE_MAX_BYTES)
        assert len(sc._ev[records.EVENTS_JSONL].carry) <= scanner.EVENT_LINE_MAX_BYTES
    assert state.stage == "data" and state.skipped_event_lines >= 1
    with events.open("ab") as fh:
        fh.write(b'\n{"kind": "stage", "stage": "training"}\n')
    for _ in range(4):
        state = sc.poll(budget_bytes=2 * scanner.EVENT_LINE_MAX_BYTES)
    assert state.stage == "training"


def test_runs_are_listed_by_launch_time_not_by_when_their_directory_last_changed(tmp_path: Path) -> None:
    """A run's directory changes when it ends (exit.json): sorted by mtime, an older run that ended was listed as
    newer than a run launched after it. Generated ids spell the launch time; a chosen id falls back to mtime."""
    older = records.new_run_id(1_800_000_000.0)
    newer = records.new_run_id(1_800_000_060.0)
    for name in (older, newer, "my-run"):
        records.run_dir_for(tmp_path, name).mkdir(parents=True)
    os.utime(records.run_dir_for(tmp_path, newer), (1_800_000_070.0, 1_800_000_070.0))
    os.utime(records.run_dir_for(tmp_path, "my-run"), (1_800_000_030.0, 1_800_000_030.0))
    os.utime(records.run_dir_for(tmp_path, older), (1_800_000_090.0, 1_800_000_090.0))  # it ended last
    assert [p.name for p in records.list_runs(tmp_path)] == [older, "my-run", newer]


def test_runs_launched_within_one_second_are_listed_in_the_order_their_submitted_records_say(tmp_path: Path) -> None:
    """Two generated ids of one second differ only in their random part: the launch time submitted.json records
    orders them (CI saw `runs` list a run launched second as the older one). A run of that second with no
    submitted.json yet (being launched) comes last of its second."""
    t = 1_800_000_000.0
    second, first = f"{records.new_run_id(t)[:-4]}0000", f"{records.new_run_id(t)[:-4]}ffff"  # names say the opposite
    pending, earlier = f"{records.new_run_id(t)[:-4]}0001", records.new_run_id(t - 1)
    for name, at in ((first, t + 0.1), (second, t + 0.7), (pending, None), (earlier, t - 0.5)):
        run_dir = records.run_dir_for(tmp_path, name)
        run_dir.mkdir(parents=True)
        if at is not None:
            (run_dir / records.SUBMITTED_JSON).write_text(json.dumps({"t": at, "phase": "accepted"}))
    assert [p.name for p in records.list_runs(tmp_path)] == [earlier, first, second, pending]


def test_unended_runs_are_those_without_an_exit_record_and_the_ended_ones_are_cached(tmp_path: Path) -> None:
    ended_run, going, also_going = (records.new_run_id(1_800_000_000.0 + 60 * i) for i in range(3))
    for name in (ended_run, going, also_going):
        records.run_dir_for(tmp_path, name).mkdir(parents=True)
    (records.run_dir_for(tmp_path, ended_run) / records.EXIT_JSON).write_text(json.dumps({"exit_code": 0}))
    cache: set[str] = set()
    assert [p.name for p in records.unended_runs(tmp_path, cache)] == [going, also_going]
    assert cache == {ended_run}
    (records.run_dir_for(tmp_path, going) / records.EXIT_JSON).write_text(json.dumps({"exit_code": 1}))
    assert [p.name for p in records.unended_runs(tmp_path, cache)] == [also_going]
    assert cache == {ended_run, going}
    assert records.unended_runs(tmp_path / "nowhere") == []
