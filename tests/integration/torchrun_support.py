"""What the torchrun tests share: the tiny engine config they start (two replica threads per rank, CPU, a few MB
of model), and a wait for node 0's rendezvous store."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

from support.waiting import wait_until

TINY_ENGINE_TOML = """
target = "tiny"
target_devices = ["cpu"]
drafter_devices = ["cpu", "cpu"]
drafter_mode = "replicas"
buckets = [64]
batch_size = 2
ttt_steps = 2
draft_vocab_size = 64
torch_threads = 1
tiny_hidden = 32
tiny_layers = 4
eval_holdout = 0
heartbeat_interval_s = 0.5
"""


def wait_listening(port: int, timeout_s: float) -> None:
    """Until something listens on 127.0.0.1:``port``: start node 1 only once node 0's agent hosts the c10d store.

    On real machines only the endpoint's host can bind its port; on loopback the first agent to bind it hosts it,
    and if that is node 1's, killing node 1 takes node 0's agent down first: it SIGTERMs its rank before the rank
    can see its peer go (a flake seen in the full suite)."""

    def listening() -> bool:
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(listening, timeout_s, f"a listener on 127.0.0.1:{port}", interval_s=0.1)


def complete_events(path: Path) -> list[dict[str, Any]]:
    """The events in a rank's ``events*.jsonl`` so far, none while it is not there yet.

    The rank is still writing it, so only lines ended by a newline are read: the last one may be half written
    (a flake seen in the full suite). A torn line before the end still fails the parse."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    complete = text[: text.rfind("\n") + 1]
    return [json.loads(line) for line in complete.splitlines() if line.strip()]
