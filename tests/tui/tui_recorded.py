"""Recorded agent events (wire-shaped dicts, per engine/protocol/agent_events.py) and a session that records requests.

Used for deterministic snapshots and for key paths that need a state the real agent cannot be put
in on this machine (a dead drafter thread, a phantom-busy GPU, a lost link). Tests only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from engine.protocol import HelloEvent, encode_log_data, from_json
from tui.link.events import ClientEvent, ConnectionEvent, decode
from tui.link.transport import ConnectOptions

T0 = 1_764_400_000.0  # a fixed clock for snapshots
RUN_ID = "20261129-111500-ab12"


class CommandFailed(Exception):
    pass


class RecordingSession:
    """Answers commands from a table and records every request; decodes the events it is given for its listeners,
    as the real session does."""

    def __init__(self, target: str = "root@gpu-box [pct 200]", replies: dict[str, Any] | None = None) -> None:
        self.target_display = target
        self.state = "connected"
        self.agent: HelloEvent | None = from_json(HelloEvent, hello())
        self.rtt_ms: float | None = 12.0
        self.opts = ConnectOptions()
        self.engine_pythonpath: str | None = None  # where the engine was shipped on the host (none: it is installed)
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.replies: dict[str, Any] = replies or {}
        self.listeners: list[Callable[[ClientEvent], None]] = []
        self.closed = False
        self.streams_started = False
        self.argv_prefix = ["ssh", "-t", "-p", "22", "root@gpu-box", "pct", "exec", "200", "--"]

    async def connect(self) -> None:
        self.state = "connected"

    async def request(
        self, cmd: str, *, timeout_s: float | None = None, params: dict[str, Any] | None = None, **args: Any
    ) -> dict[str, Any]:
        args = {**args, **(params or {})}
        self.requests.append((cmd, args))
        await asyncio.sleep(0)
        reply = self.replies.get(cmd, {})
        if callable(reply):
            reply = reply(args)
        if isinstance(reply, Exception):
            raise reply
        return dict(reply)

    def add_event_listener(self, fn: Callable[[ClientEvent], None]) -> Callable[[], None]:
        self.listeners.append(fn)
        return lambda: self.listeners.remove(fn) if fn in self.listeners else None

    async def start_streams(self, gpu_interval_s: float = 0.5, procs_interval_s: float = 1.0) -> None:
        self.streams_started = True

    def attach_argv(self, tmux_session: str) -> list[str]:
        return [*self.argv_prefix, "tmux", "attach", "-t", tmux_session]

    async def close(self) -> None:
        self.closed = True
        self.state = "disconnected"

    def emit(self, *events: dict[str, Any] | ClientEvent) -> None:
        """Wire-shaped dicts are decoded here (the session's boundary); decoded events pass as they are."""
        for ev in events:
            if isinstance(ev, dict):
                # the session's own connection events are made by the session, never decoded from the agent
                typed = from_json(ConnectionEvent, ev) if ev.get("ev") == "connection" else decode(ev)
            else:
                typed = ev
            for fn in list(self.listeners):
                fn(typed)

    def commands(self) -> list[str]:
        return [cmd for cmd, _ in self.requests]


def hello() -> dict[str, Any]:
    return {
        "ev": "hello",
        "protocol": 1,
        "agent_version": "0.1.0",
        "hostname": "gpu-box",
        "boot_id": "b1",
        "python": "3.11.7",
        "pid": 4242,
        "run_root": "/root/.specdec",
        "simulated": False,
        "capabilities": {},
    }


def gpu(
    index: int,
    util: float,
    used: float,
    total: float = 143_771.0,
    holders: list[int] | None = None,
    simulated: bool = False,
) -> dict[str, Any]:
    return {
        "index": index,
        "name": "NVIDIA H200",
        "uuid": f"GPU-{index}",
        "util_pct": util,
        "mem_used_mib": used,
        "mem_total_mib": total,
        "temp_c": 40.0 + util / 4,
        "power_w": 90.0 + util * 5,
        "holder_pids": holders or [],
        "simulated": simulated,
    }


def gpus_event(gpus: list[dict[str, Any]], t: float = T0, simulated: bool = False) -> dict[str, Any]:
    return {"ev": "gpus", "t": t, "simulated": simulated, "gpus": gpus, "nvml_error": None}


def run(state: str = "running", milestones: dict[str, float | None] | None = None, **extra: Any) -> dict[str, Any]:
    ms = (
        milestones
        if milestones is not None
        else {"submitted": T0, "started": T0 + 0.3, "output": T0 + 1.2, "first-step": T0 + 9.8}
    )
    base = {
        "run_id": RUN_ID,
        "run_dir": f"/root/.specdec/runs/{RUN_ID}",
        "state": state,
        "command": ["python3", "-m", "engine.trainer", "--preset", "cpu-demo"],
        "cwd": "/root/work",
        "pid": 5001,
        "pgid": 5001,
        "started_at": T0 + 0.3,
        "tmux_session": f"specdec-{RUN_ID}",
        "attachable": True,
        "milestones": ms,
        "stage": "training",
        "profile": "default",
    }
    base.update(extra)
    return {"ev": "run", "run": base}


def procs_event(threads: list[str], holders: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "ev": "procs",
        "t": T0 + 30,
        "run_tree": [
            {
                "pid": 5001,
                "ppid": 1,
                "user": "root",
                "cmd": "python3 -m engine.trainer --preset cpu-demo",
                "cpu_pct": 310.0,
                "rss_mib": 2150.0,
                "create_time": T0,
                "state": "running",
                "threads": [{"tid": 5001 + i + 1, "name": name} for i, name in enumerate(threads)],
            },
        ],
        "holders": holders or [],
    }


def log_event(offset: int, text: str, inode: int = 77) -> dict[str, Any]:
    return {"ev": "log", "offset": offset, "inode": inode, "data": encode_log_data(text.encode())}


def log_events(lines: list[str], start: int = 0, inode: int = 77) -> tuple[list[dict[str, Any]], int]:
    out = []
    offset = start
    for line in lines:
        data = line + "\n"
        out.append(log_event(offset, data, inode))
        offset += len(data.encode())
    return out, offset


def engine_events(threads: list[str], steps: int, start_offset: int = 0, t0: float = T0 + 10) -> list[dict[str, Any]]:
    out = []
    offset = start_offset
    for step in range(1, steps + 1):
        for i, thread in enumerate(threads):
            offset += 200
            loss = [2.5 - step * 0.05 - i * 0.1 + k * 0.2 for k in range(4)]
            acc = [max(0.0, 0.4 + step * 0.02 - k * 0.08) for k in range(4)]
            out.append(
                {
                    "ev": "engine",
                    "offset": offset,
                    "event": {
                        "t": t0 + step,
                        "kind": "step",
                        "thread": thread,
                        "step": step,
                        "loss": loss,
                        "loss_total": sum(0.8**k * x for k, x in enumerate(loss)),
                        "acc": acc,
                        "tok_s": 12_000 + step * 40 + i * 300,
                        "ms": {"fetch": 1, "fwd": 60, "bwd": 80, "opt": 5},
                    },
                }
            )
            offset += 150
            out.append(
                {
                    "ev": "engine",
                    "offset": offset,
                    "event": {
                        "t": t0 + step + 0.1,
                        "kind": "heartbeat",
                        "thread": thread,
                        "state": "training",
                        "step": step,
                        "tok_s": 12_000 + step * 40,
                        "queue_depth": 2,
                        "last_exception": None,
                    },
                }
            )
    return out


def healthy_events(threads: tuple[str, ...] = ("drafter-0", "drafter-1")) -> list[dict[str, Any]]:
    logs, _ = log_events(
        [
            "\x1b[32mINFO\x1b[0m loading target /models/llama-8b",
            "imports done in 2.1 s",
            "10%|█         | 1/10\r50%|█████     | 5/10\r100%|██████████| 10/10",
            "warmup drafter-0 bucket 2048 ok",
            "step=1 loss=2.41 12.0k tok/s",
            "step=2 loss=2.30 12.1k tok/s",
            "step=3 loss=2.22 12.3k tok/s",
        ]
    )
    return [
        hello(),
        {"ev": "connection", "state": "connected", "detail": "agent 0.1.0 on gpu-box", "attempt": 0},
        gpus_event([gpu(0, 87, 61_000, holders=[5001]), gpu(1, 91, 60_500, holders=[5001])]),
        run(),
        procs_event(["producer-0", *threads]),
        {"ev": "anomalies", "items": []},
        *logs,
        *engine_events(list(threads), 30),
    ]
