"""Recorded output of real tools, shared by the tests that replay it."""

# torchrun 2.13's ChildFailedError summary after rank 1 raised and rank 0 was stopped (a real
# `torchrun --standalone --nproc-per-node 2` run): "Root Cause" names rank 1, exit code 1.
TORCHRUN_FAILURE_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-01_11:10:03
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 4858)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 4858
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_11:10:03
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 4859)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
