"""A torchrun worker that is the engine, except that one rank raises in its step all-reduce (an exception inside a
rank, as a bug or a failing device would raise), for the supervisor's tests. Not a test module itself.

SPECDEC_TEST_FAULT_RANK: the global rank that raises; SPECDEC_TEST_FAULT_STEP: from which step on;
SPECDEC_TEST_FAULT_ON_STOP=1: instead, once the rank is stopping (a crash on the way out of a stop). A stop's SIGTERM
reaches the ranks at different moments: a rank already inside the collective when its own signal lands learns of the
stop from the collective's answer, so the fault fires on either (raising only on the rank's own flag made the test
depend on which rank the signal reached first).
"""

from __future__ import annotations

import os
import sys
from typing import Any

from engine.trainer.__main__ import main
from engine.trainer.run import distributed

FAULT_RANK = int(os.environ["SPECDEC_TEST_FAULT_RANK"])
FAULT_STEP = int(os.environ.get("SPECDEC_TEST_FAULT_STEP", "1"))
FAULT_ON_STOP = os.environ.get("SPECDEC_TEST_FAULT_ON_STOP") == "1"
_all_reduce = distributed.CrossRank.all_reduce


def _faulty_all_reduce(self: distributed.CrossRank, *args: Any, **kwargs: Any) -> Any:
    step = args[4] if len(args) > 4 else kwargs.get("step", 0)
    stop = args[3] if len(args) > 3 else kwargs.get("stop", False)
    if self.rank == FAULT_RANK and not FAULT_ON_STOP and step >= FAULT_STEP:
        raise RuntimeError(f"injected fault on rank {self.rank} at step {step}")
    totals, world_stop = _all_reduce(self, *args, **kwargs)
    if self.rank == FAULT_RANK and FAULT_ON_STOP and (stop or world_stop):
        raise RuntimeError(f"injected fault on rank {self.rank} while stopping at step {step}")
    return totals, world_stop


distributed.CrossRank.all_reduce = _faulty_all_reduce  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
