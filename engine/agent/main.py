"""The host agent's entry point: ``python3 -m engine.agent.main`` (or ``specdec-agent``).

Importing the command modules fills the command table (engine/agent/commands.py); the server
(engine/agent/server.py) then answers with it. Stdlib only at import time; psutil, pynvml and
watchfiles are used when the host has them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

from engine.agent import monitor_cmds, net_cmds, run_cmds
from engine.agent.commands import HANDLERS, handler
from engine.agent.server import Agent
from engine.host import agents
from engine.protocol import MAX_SIMULATED_GPUS

COMMAND_MODULES = (monitor_cmds, run_cmds, net_cmds)  # imported for their @handler registrations


def default_run_root() -> Path:
    return Path(os.environ.get("SPECDEC_RUN_ROOT", "~/.specdec")).expanduser()


def build_agent(
    run_root: Path, simulate_gpus: int = 0, out: IO[bytes] | None = None, *, readonly: bool = False
) -> Agent:
    """An agent that answers every registered command (``readonly``: refuses those that act)."""
    return Agent(run_root=run_root, simulate_gpus=simulate_gpus, out=out, handlers=HANDLERS, readonly=readonly)


@handler("ping")
def _ping(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    return {"t": time.time(), "agent_pid": os.getpid(), "uptime_s": time.time() - agent.started_at}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="specdec-agent", description="specdec host agent (JSON lines on stdio)", allow_abbrev=False
    )
    parser.add_argument("--run-root", type=Path, default=None, help="run root directory (default ~/.specdec)")
    parser.add_argument(
        "--simulate-gpus", type=int, default=0, metavar="N", help="report N simulated GPUs instead of NVML"
    )
    parser.add_argument(
        "--readonly", action="store_true", help="refuse every command that launches, stops, restarts or signals"
    )
    ns = parser.parse_args(argv)
    if not 0 <= ns.simulate_gpus <= MAX_SIMULATED_GPUS:
        parser.error(f"--simulate-gpus must be 0..{MAX_SIMULATED_GPUS}, got {ns.simulate_gpus}")
    run_root = (ns.run_root or default_run_root()).expanduser()
    if run_root.exists() and not run_root.is_dir():  # every answer would be about no run at all
        parser.error(f"--run-root {run_root} is not a directory")
    agent = build_agent(run_root, ns.simulate_gpus, readonly=ns.readonly)
    entry = agents.register(run_root)  # kill-stale and the anomalies know an agent by this record, not its name
    try:
        return agent.serve()
    finally:
        agents.unregister(entry)


if __name__ == "__main__":
    sys.exit(main())
