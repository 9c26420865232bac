"""A torchrun worker that joins the world as the engine does (``CrossRank``), then leaves it cleanly and exits while
the rendezvous store's host answers late: rank 1 pauses its torchrun agent (which hosts the store under
``--standalone``) and has it resumed ``argv[1]`` seconds later, as a loaded machine does to an agent. The heartbeat
thread beats without pause, so its store call is in flight when the rank leaves. Not a test module itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from engine.trainer.run import distributed
from engine.trainer.run.torchrun import rank_from_env

distributed.BEAT_EVERY_S = 0.0
info = rank_from_env()
cross = distributed.start(info, ["cpu"], 60.0, 60.0)
wait = time.monotonic() + 5.0
while cross._store is not None and cross._store.add(distributed.BEAT_KEY.format(rank=info.rank), 0) < 10:
    assert time.monotonic() < wait, "the heartbeat thread never beat"
if info.rank == 1:
    agent = os.getppid()
    os.kill(agent, signal.SIGSTOP)
    subprocess.Popen(["sh", "-c", f"sleep {float(sys.argv[1])}; kill -CONT {agent}"])
print(f"rank {info.rank} left cleanly: {cross.close()}", flush=True)
