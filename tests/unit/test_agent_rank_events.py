"""The agent forwards the other ranks' events files of a torchrun node (events.rank<R>.jsonl) beside the run's
events.jsonl: as engine events naming their file, without an offset; a resumed stream takes them from their end."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from support.agent import AgentClient
from test_agent_status import make_run

from engine.supervisor import records


def beat(rank: int, step: int) -> bytes:
    ev: dict[str, Any] = {"t": time.time(), "kind": "heartbeat", "thread": "drafter0", "state": "running",
                          "step": step, "rank": rank, "world_size": 2, "node": 0}  # fmt: skip
    return json.dumps(ev).encode() + b"\n"


def test_rank_files_are_forwarded_without_offsets_and_a_resumed_stream_starts_at_their_end(
    agent: AgentClient, run_root: Path
) -> None:
    rd = make_run(run_root, "run-t")
    (rd / records.EVENTS_JSONL).write_bytes(beat(0, 1))
    rank1 = rd / "events.rank1.jsonl"
    rank1.write_bytes(beat(1, 1))
    agent.ok("subscribe")
    main = agent.next_event(lambda e: e["ev"] == "engine" and "source" not in e, what="rank 0 event")
    other = agent.next_event(lambda e: e["ev"] == "engine" and e.get("source") == rank1.name, what="rank 1 event")
    assert main["event"]["rank"] == 0 and isinstance(main["offset"], int)
    assert other["event"]["rank"] == 1 and other["event"]["step"] == 1 and "offset" not in other
    with open(rank1, "ab") as fh:
        fh.write(beat(1, 2))
    live = agent.next_event(lambda e: e.get("source") == rank1.name, what="rank 1's next heartbeat")
    assert live["event"]["step"] == 2

    agent.ok("subscribe", engine_offset=main["offset"], engine_inode=main["inode"], run_id="run-t")
    agent.drain()
    step = 3
    resumed: dict[str, Any] | None = None
    while resumed is None and step < 50:  # beats until the new stream is up (it starts at the file's end then)
        with open(rank1, "ab") as fh:
            fh.write(beat(1, step))
        step += 1
        try:
            resumed = agent.next_event(lambda e: e.get("source") == rank1.name, 0.2, "rank 1 after the resubscribe")
        except AssertionError:
            continue
    assert resumed is not None and resumed["event"]["step"] >= 3  # its history (steps 1 and 2) was not sent again
