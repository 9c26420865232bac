"""The run scanner over every rank's events file: first-step when every rank of the node stepped, and the rank
that failed first named from torchrun's root cause and the ranks' own events."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from engine.supervisor import records
from engine.supervisor.records import ExitRecord


def write_events(path: Path, *events: dict[str, Any]) -> None:
    with path.open("a", encoding="utf-8") as fh:
        for ev in events:
            fh.write(json.dumps({"t": time.time(), **ev}) + "\n")


def tags(rank: int, node: int = 0, world: int = 2) -> dict[str, int]:
    return {"rank": rank, "world_size": world, "node": node}


def distributed(rank: int, local_world: int = 2, node: int = 0) -> dict[str, Any]:
    return {"kind": "stage", "stage": "distributed", "pid": 1000 + rank, "local_world_size": local_world,
            **tags(rank, node)}  # fmt: skip


def test_first_step_waits_for_every_rank_of_the_node_not_the_first_one(tmp_path: Path) -> None:
    (tmp_path / records.OUTPUT_LOG).write_text("step=1 loss=1.0\n")  # rank 0's line: not first-step for an engine
    write_events(tmp_path / "events.jsonl", distributed(0), {"kind": "step", "step": 1, **tags(0)})
    scanner = records.RunScanner(tmp_path, r"step=\d+")
    st = scanner.poll()
    assert st.first_step_t is None and st.log_step_seen_at is None
    write_events(tmp_path / "events.rank1.jsonl", distributed(1), {"kind": "step", "step": 1, **tags(1)})
    st = scanner.poll()
    assert st.first_step_t is not None
    assert st.ranks[1].pid == 1001 and st.ranks[0].last_step == 1


def test_without_local_world_size_the_torchrun_command_says_how_many_ranks(tmp_path: Path) -> None:
    write_events(tmp_path / "events.jsonl", {"kind": "step", "step": 1, **tags(0)})
    scanner = records.RunScanner(tmp_path, None, nproc_hint=records.nproc_per_node(["torchrun", "--nproc-per-node=2"]))
    assert scanner.poll().first_step_t is None
    write_events(tmp_path / "events.rank1.jsonl", {"kind": "step", "step": 1, **tags(1)})
    assert scanner.poll().first_step_t is not None


def test_a_foreign_command_keeps_the_step_pattern(tmp_path: Path) -> None:
    (tmp_path / records.OUTPUT_LOG).write_text("epoch 1 step=3\n")
    st = records.RunScanner(tmp_path, r"step=\d+").poll()
    assert st.log_step_seen_at is not None and st.log_last_step == 3 and not st.distributed()


ROOT_CAUSE_KILLED = b"""Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_11:54:14
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 17257)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 17257
============================================================
"""


def test_a_killed_rank_is_named_with_its_signal_not_the_peer_error_it_caused(tmp_path: Path) -> None:
    peer_said = "thread drafter1 failed: PeerFailure: rank 0 (node 0): gradient all-reduce of step 12 failed: " \
        "peer rank 1 (node 0, vm pid 17257) is gone: RuntimeError: Connection reset by peer"  # fmt: skip
    write_events(
        tmp_path / "events.jsonl",
        distributed(0),
        {"kind": "thread_error", "thread": "drafter1", "exc_type": "PeerFailure", "message": peer_said, **tags(0)},
        {"kind": "run_end", "ok": False, "reason": peer_said, "step": 11, **tags(0)},
    )
    write_events(tmp_path / "events.rank1.jsonl", distributed(1), {"kind": "step", "step": 11, **tags(1)})
    (tmp_path / records.OUTPUT_LOG).write_bytes(
        b"Traceback (most recent call last):\nRuntimeError: reset\n" + ROOT_CAUSE_KILLED
    )
    st = records.RunScanner(tmp_path, r"step=\d+").catch_up()
    failed = records.rank_failure(st)
    assert failed == records.RankFailure("rank 1 (node 0) killed by SIGKILL", 1, 0)
    cause = records.failure_cause(st, ExitRecord(exit_code=1), 11)
    assert cause.startswith("rank 1 (node 0) killed by SIGKILL; exit code 1"), cause


def test_a_rank_that_raised_is_named_with_its_exception(tmp_path: Path) -> None:
    write_events(tmp_path / "events.jsonl", distributed(0))
    write_events(
        tmp_path / "events.rank1.jsonl",
        distributed(1),
        {"kind": "thread_error", "thread": "drafter0", "exc_type": "RuntimeError", "message": "boom", **tags(1)},
    )
    failed = records.rank_failure(records.RunScanner(tmp_path, None).poll())
    assert failed == records.RankFailure("rank 1 (node 0): thread drafter0: RuntimeError: boom", 1, 0)


def test_the_surviving_node_names_the_rank_of_the_other_node(tmp_path: Path) -> None:
    said = "rank 0 (node 0): gradient all-reduce of step 5 failed: peer rank 1 (node 1, hostb pid 77) is gone: x"
    write_events(
        tmp_path / "events.jsonl",
        distributed(0, local_world=1),
        {"kind": "run_end", "ok": False, "reason": said, "step": 4, **tags(0)},
    )
    failed = records.rank_failure(records.RunScanner(tmp_path, None).poll())
    assert failed is not None and (failed.rank, failed.node) == (1, 1)
    assert failed.text.startswith("rank 1 (node 1) failed or left the run; rank 0 (node 0) said: ")


def test_rank_last_lines_are_that_ranks_own(tmp_path: Path) -> None:
    log = tmp_path / records.OUTPUT_LOG
    log.write_text("step=3 loss 1\n[rank 1] step=3 loss 2\n[rank 1] thread drafter0 died\nW torchrun warning\n")
    assert records.rank_last_lines(log, 1) == ["[rank 1] step=3 loss 2", "[rank 1] thread drafter0 died"]
    assert records.rank_last_lines(log, 0) == ["step=3 loss 1", "W torchrun warning"]


def test_a_timed_out_collective_with_one_peer_names_that_peer(tmp_path: Path) -> None:
    said = "rank 0 (node 0): gradient all-reduce of step 5 failed: a peer failed or timed out after 60 s; peers: " \
        "rank 1 (node 1, hostb): RuntimeError: Connection closed by peer"  # fmt: skip
    write_events(tmp_path / "events.jsonl", {"kind": "run_end", "ok": False, "reason": said, "step": 4, **tags(0)})
    failed = records.rank_failure(records.RunScanner(tmp_path, None).poll())
    assert failed is not None and (failed.rank, failed.node) == (1, 1), failed


def test_on_the_second_node_its_first_rank_speaks_for_the_run(tmp_path: Path) -> None:
    # Node 1's only rank is global rank 1, writing that node's events.jsonl: its stages and steps are the run's.
    write_events(
        tmp_path / "events.jsonl",
        distributed(1, local_world=1, node=1),
        {"kind": "stage", "stage": "training", **tags(1, node=1)},
        {"kind": "step", "step": 4, **tags(1, node=1)},
    )
    st = records.RunScanner(tmp_path, None).poll()
    assert st.stage == "training" and st.last_step == 4 and st.first_step_t is not None


def test_a_run_killed_by_a_signal_says_so_once() -> None:
    # The wrapper records "killed by signal 11 (SIGSEGV)" as its cause; the exit record has the signal too.
    cause = records.failure_cause(None, ExitRecord(signal=11, cause="killed by signal 11 (SIGSEGV)"), 80)
    assert cause == "killed by signal 11 (SIGSEGV); last step 80"
    assert cause.count("SIGSEGV") == 1


# torchrun's own words when it gets SIGTERM (its elastic agent raises SignalException, then it exits 1).
TORCHRUN_SIGTERM = b"""W1202 01:40:03.154000 4732 torch/distributed/elastic/agent/server/api.py:719] Received 15 \
death signal, shutting down workers
Traceback (most recent call last):
  File "torch/distributed/elastic/multiprocessing/api.py", line 84, in _terminate_process_handler
    raise SignalException(f"Process {os.getpid()} got signal: {sigval}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 4732 got signal: 15
"""


def stopped_ranks(tmp_path: Path, rank1_end: dict[str, Any] | None) -> records.ScanState:
    write_events(
        tmp_path / "events.jsonl",
        distributed(0),
        {"kind": "run_end", "ok": True, "reason": "SIGTERM", "step": 40, **tags(0)},
    )
    write_events(tmp_path / "events.rank1.jsonl", distributed(1), *([rank1_end] if rank1_end else []))
    (tmp_path / records.OUTPUT_LOG).write_bytes(b"step=40 loss=1.0\n" + TORCHRUN_SIGTERM)
    return records.RunScanner(tmp_path, r"step=\d+").catch_up()


def test_a_stopped_torchrun_run_whose_ranks_all_ended_cleanly_is_stopped_not_torchruns_exit_1(tmp_path: Path) -> None:
    st = stopped_ranks(tmp_path, {"kind": "run_end", "ok": True, "reason": "SIGTERM", "step": 40, **tags(1)})
    said = records.stopped_cause(st, 1, None, "SIGTERM")
    assert said == "stopped (SIGTERM), torchrun exited with code 1; every rank ended cleanly"
    records.write_exit_record(tmp_path, ExitRecord(exit_code=1, cause=said, stop_requested="stop", stopped=True))
    info = records.read_run(tmp_path, "boot")
    assert info.state == "stopped" and info.cause == said and info.failed_rank is None


def test_a_rank_that_raised_after_the_stop_keeps_the_run_failed_with_its_exception(tmp_path: Path) -> None:
    boom = {"kind": "thread_error", "thread": "drafter0", "exc_type": "RuntimeError", "message": "boom", **tags(1)}
    write_events(tmp_path / "events.rank1.jsonl", boom)
    st = stopped_ranks(tmp_path, {"kind": "run_end", "ok": False, "reason": "boom", "step": 39, **tags(1)})
    assert records.stopped_cause(st, 1, None, "SIGTERM") is None
    assert records.failure_cause(st, ExitRecord(exit_code=1), 40).startswith("rank 1 (node 0): thread drafter0: ")


def test_a_rank_that_never_said_how_it_ended_leaves_the_stop_unproven(tmp_path: Path) -> None:
    assert records.stopped_cause(stopped_ranks(tmp_path, None), 1, None, "SIGTERM") is None


def test_a_plain_job_killed_by_the_stops_sigterm_is_stopped_but_one_that_exits_1_is_not(tmp_path: Path) -> None:
    st = records.RunScanner(tmp_path, r"step=\d+").catch_up()
    assert records.stopped_cause(st, None, 15, "SIGTERM") == "stopped (SIGTERM): killed by signal 15 (SIGTERM)"
    assert records.stopped_cause(st, 1, None, "SIGTERM") is None
    # A job that handled the stop's SIGTERM and ended cleanly (the engine checkpoints, then exits 0) was stopped too.
    assert records.stopped_cause(st, 0, None, "SIGTERM") == "stopped (SIGTERM): exited with code 0"
