"""The torchrun command line of a multi-process run, and the rank a process was started as.

Stdlib only: ``specdec-train --print-torchrun`` builds the command before torch is imported, and the events
of a rank are tagged before torch is imported.

Layouts: one rank per node (the default; each rank is the threaded engine over the node's GPUs) or one rank per
GPU (``nproc_per_node`` > 1; each rank's devices are shifted to its own GPUs, see ``distributed.map_devices``).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

# Set by torchrun in every worker it starts.
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_GROUP_RANK = "GROUP_RANK"  # the node's rank
ENV_MASTER_ADDR = "MASTER_ADDR"  # where the ranks' store is: without it there is no world to join


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in a torchrun world (rank 0 of 1 outside torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0
    launched: bool = False  # started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR set), even as a world of one

    def tags(self) -> dict[str, int]:
        """Fields added to every event of a rank of a torchrun world (none for a plain process)."""
        if not self.launched:
            return {}
        return {"rank": self.rank, "world_size": self.world_size, "node": self.node}


def rank_from_env(env: dict[str, str] | None = None) -> RankInfo:
    e = os.environ if env is None else env
    if ENV_RANK not in e or ENV_WORLD_SIZE not in e or ENV_MASTER_ADDR not in e:
        return RankInfo()

    def num(key: str, default: int) -> int:
        try:
            return int(e.get(key, default))
        except ValueError:
            return default

    return RankInfo(
        rank=num(ENV_RANK, 0),
        world_size=num(ENV_WORLD_SIZE, 1),
        local_rank=num(ENV_LOCAL_RANK, 0),
        local_world_size=num(ENV_LOCAL_WORLD_SIZE, 1),
        node=num(ENV_GROUP_RANK, 0),
        launched=True,
    )


def events_path_for_rank(path: Path, info: RankInfo) -> Path:
    """The first rank of a node writes the run's events.jsonl; other ranks of that node, which share the run
    directory, write events.rank<R>.jsonl beside it (R = the global rank)."""
    if info.local_rank == 0:
        return path
    return path.with_name(f"{path.stem}.rank{info.rank}{path.suffix}")


def torchrun_program() -> list[str]:
    """``torchrun`` when it is on PATH, else this interpreter's ``-m torch.distributed.run`` (the same tool)."""
    found = shutil.which("torchrun")
    return ["torchrun"] if found else [sys.executable, "-m", "torch.distributed.run"]


def torchrun_command(
    engine_args: list[str],
    *,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str,
    program: list[str] | None = None,
) -> list[str]:
    """``torchrun ... -m engine.trainer <engine_args>``: c10d rendezvous at ``rdzv_endpoint`` for several nodes,
    ``--standalone`` (a local rendezvous on a free port) for one."""
    cmd = list(program if program is not None else torchrun_program())
    if nnodes == 1 and not rdzv_endpoint:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        cmd += [
            "--nnodes",
            str(nnodes),
            "--node-rank",
            str(node_rank),
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            rdzv_endpoint,
        ]
    cmd += ["--nproc-per-node", str(nproc_per_node), "--max-restarts", "0", "-m", "engine.trainer", *engine_args]
    return cmd


def shell_line(cmd: list[str]) -> str:
    return " ".join(shlex.quote(c) for c in cmd)
