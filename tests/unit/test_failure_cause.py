"""A failed run names its root cause from output.log: the first exception, torchrun's failing rank, the last step."""

from __future__ import annotations

import re

from support.recorded import TORCHRUN_FAILURE_SUMMARY

from engine.supervisor.records.log_failure import FailureScan, last_step_in

# torchrun 2.13's own words (a real `torchrun --standalone --nproc-per-node 2` run, paths shortened), with the
# surviving rank's consequential error printed BEFORE the root cause's, as happens when rank 0 reaches the log first.
TORCHRUN_LOG = b"""\
rank 0 step=29
rank 1 step=30
[rank0]: Traceback (most recent call last):
[rank0]:   File "/tmp/tr/train.py", line 9, in <module>
[rank0]:     dist.barrier()
[rank0]: RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:36273.
[rank1]: Traceback (most recent call last):
[rank1]:   File "/tmp/tr/train.py", line 8, in <module>
[rank1]:     raise RuntimeError("rank 1 exploded at step 30")
[rank1]: RuntimeError: rank 1 exploded at step 30
W1201 11:10:03.154000 4732 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 4858 closing
E1201 11:10:03.272000 4732 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
""" + TORCHRUN_FAILURE_SUMMARY.encode()


def _scan(log: bytes, piece: int) -> FailureScan:
    scan = FailureScan()
    lines = log.splitlines(keepends=True)
    for i in range(0, len(lines), piece):  # fed as the log grows, in any slicing of whole lines
        scan.feed(b"".join(lines[i : i + piece]))
    return scan


def test_torchrun_root_cause_names_the_failing_rank_and_its_own_exception_not_the_first_in_the_log() -> None:
    for piece in (1, 3, 1000):
        f = _scan(TORCHRUN_LOG, piece).failure
        assert (f.root_rank, f.root_local_rank, f.root_exitcode) == (1, 1, 1)
        assert f.describe() == (
            "torchrun: rank 1 (local_rank 1) exited with code 1: RuntimeError: rank 1 exploded at step 30"
        )


def test_without_rank_prefixes_the_first_exception_that_is_not_torchruns_wrapper_is_named() -> None:
    log = re.sub(rb"\[rank\d\]: ", b"", TORCHRUN_LOG)
    f = _scan(log, 1000).failure
    assert f.describe() is not None and f.describe().startswith("torchrun: rank 1 (local_rank 1) exited with code 1: ")
    assert "ChildFailedError" not in (f.describe() or "")


def test_a_plain_traceback_names_its_final_line_and_a_chained_one_its_first() -> None:
    log = b"""step=1
Traceback (most recent call last):
  File "train.py", line 3, in <module>
    load()
KeyError: 'weights'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "train.py", line 5, in <module>
ValueError: checkpoint unreadable
"""
    assert _scan(log, 2).failure.describe() == "KeyError: 'weights'"


def test_a_log_that_only_mentions_errors_names_nothing() -> None:
    log = b"RuntimeError: this line is a message, not a traceback\nValueError all fine\nstep=3\n"
    assert _scan(log, 1).failure.describe() is None


def test_last_step_is_the_number_in_the_last_match_of_the_step_pattern() -> None:
    assert last_step_in(b"step=1\nstep=29\nrank 1 step=30\nloss 0.1\n", re.compile(rb"step=\d+")) == 30
    assert last_step_in(b"it 7/100\nit 8/100\n", re.compile(rb"it (\d+)/")) == 8
    assert last_step_in(b"no steps here\n", re.compile(rb"step=\d+")) is None
