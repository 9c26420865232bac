"""Engine output: structured events to events.jsonl (engine.protocol's engine-event dataclasses, written by
``encode_engine_event``) and human lines on stdout.

Stdlib only, so ``__main__`` can report the ``imports`` stage before torch is imported.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from engine.protocol import ENV_EVENTS_PATH, CompileEvent, EngineEvent, StageEvent, encode_engine_event


def events_path_for(output_dir: str | Path) -> Path:
    env = os.environ.get(ENV_EVENTS_PATH)
    return Path(env) if env else Path(output_dir).expanduser() / "events.jsonl"  # "~/run" as the engine reads it


class EventLog:
    """Appends one engine event per line, flushed at once; thread-safe.

    ``tags`` are added to every event (a torchrun rank's ``rank``, ``world_size`` and ``node``); ``prefix`` starts
    every human line (``[rank 1] ``), so the ranks' lines in one output.log can be told apart. ``listeners`` get
    each event as the JSON object its line holds."""

    def __init__(
        self,
        path: str | Path | None,
        stdout: IO[str] | None = None,
        *,
        tags: dict[str, int] | None = None,
        prefix: str = "",
    ) -> None:
        self.path = Path(path) if path is not None else None
        self.tags = dict(tags or {})
        self.prefix = prefix
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self._stdout = stdout if stdout is not None else sys.stdout
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")
        # callables(event): progress record, evaluation, benches and tests
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._stdout_broken = False

    def emit(self, event: EngineEvent) -> dict[str, Any]:
        """Write ``event`` (stamped with the time, unless it has one, and the tags); returns its JSON object."""
        obj = self._encode(event)
        line = json.dumps(obj, separators=(",", ":"))
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")
                self._file.flush()
        for fn in list(self.listeners):
            fn(obj)
        return obj

    def _encode(self, event: EngineEvent) -> dict[str, Any]:
        tags = self.tags
        stamped = replace(
            event,
            t=time.time() if event.t is None else event.t,
            rank=tags.get("rank") if event.rank is None else event.rank,
            node=tags.get("node") if event.node is None else event.node,
            world_size=tags.get("world_size") if event.world_size is None else event.world_size,
        )
        return encode_engine_event(stamped)

    def say(self, text: str) -> None:
        """A human line on stdout, flushed (the supervisor's step pattern matches ``step=N``)."""
        with self._lock:
            if self._stdout_broken:
                return
            try:
                self._stdout.write(self.prefix + text + "\n")
                self._stdout.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                # A closed stdout must not kill training threads; events.jsonl still gets everything.
                self._stdout_broken = True
                if self._file is not None:  # under the lock already: written here, not through emit
                    detail = f"stdout unavailable ({type(exc).__name__}); human log lines stop here"
                    note = self._encode(StageEvent(stage="training", detail=detail))
                    self._file.write(json.dumps(note, separators=(",", ":")) + "\n")
                    self._file.flush()

    def stage(self, stage: str, detail: str = "", thread: str | None = None) -> None:
        self.emit(StageEvent(stage=stage, thread=thread, detail=detail))
        who = f" [{thread}]" if thread else ""
        self.say(f"stage={stage}{who} {detail}".rstrip())

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def compile_message(event: CompileEvent) -> str:
    """One line for a compile event (see compile.GuardedFunction)."""
    who, fn = event.thread, event.function
    graphs, limit, sig = event.graphs, event.limit, event.signature
    if event.what == "fallback":
        return (
            f"{who}: compile fallback: {fn} hit the recompile limit ({graphs} of {limit} graphs); new input "
            f"signatures run eagerly from here (slow); last signature: {sig}"
        )
    because = f"; the guard that failed: {event.guard}" if event.guard else ""
    return f"{who}: {fn} recompiled after warm-up (graph {graphs}, limit {limit}) for signature: {sig}{because}"


def compile_listener(events: EventLog) -> Callable[[CompileEvent], None]:
    """A GuardedFunction listener that writes each compile event to ``events`` and a warning line to stdout."""

    def on_compile(event: CompileEvent) -> None:
        events.emit(event)
        events.say(f"warning: {compile_message(event)}")

    return on_compile


def fmt(x: float) -> str:
    return "nan" if not math.isfinite(x) else f"{x:.4f}"


def step_line(
    thread: str,
    step: int,
    loss: list[float],
    loss_total: float,
    acc: list[float],
    tok_s: float,
    useful_tok_s: float | None = None,
) -> str:
    """The human step line; ``loss_total`` is the weighted total trained on (``draft.loss.weighted_total``);
    ``useful_tok_s`` (the tokens inside conversations, for a batch with padding) follows ``tok/s`` when given."""
    useful = f" useful_tok/s={useful_tok_s:.0f}" if useful_tok_s is not None else ""
    return (
        f"step={step} thread={thread} loss={fmt(loss_total)} loss0={fmt(loss[0])} acc0={fmt(acc[0])} "
        f"acc_last={fmt(acc[-1])} tok/s={tok_s:.0f}{useful}"
    )


@dataclass(frozen=True)
class Layout:
    """Where the target and the drafters run on ``gpus`` GPUs."""

    colocated: bool  # a target replica and a drafter replica on every GPU
    target_gpus: int
    drafter_gpus: int
    why: str


# Of a GPU's memory, the share a co-located target + drafter may plan to use (allocator slack, activations' peaks).
COLOCATE_MEMORY_SHARE = 0.9


def suggest_split(
    target_tok_s: float,
    drafter_tok_s: float,
    gpus: int,
    *,
    target_gib: float | None = None,
    drafter_gib: float | None = None,
    gpu_gib: float | None = None,
) -> Layout:
    """Co-location first: a target and a drafter replica on every GPU whenever the target fits beside the drafter
    (memory unknown counts as fitting). Measured on 2xH200 (8B-shape target, seq 2048, batch 2 per GPU):
    co-located replicas 32.3k tok/s, a 1:1 target/drafter split 31.0k, 1 target + 2 drafters 22.3k: a split
    pays the hidden-state and target-distribution transfers and idles one side, so it is only proposed when
    the two do not fit on one GPU. The split then balances the sides' per-GPU token rates:
    n_target * target_tok_s ~ n_drafter * drafter_tok_s with n_target + n_drafter = gpus, each side >= 1 GPU.
    """
    if target_gib is None or drafter_gib is None or gpu_gib is None:
        return Layout(True, gpus, gpus, "co-located on every GPU (memory not given: co-location is the default)")
    sizes = f"target {target_gib:.1f} GiB + drafter {drafter_gib:.1f} GiB"
    if target_gib + drafter_gib <= COLOCATE_MEMORY_SHARE * gpu_gib:
        return Layout(True, gpus, gpus, f"co-located on every GPU ({sizes} fit on a {gpu_gib:.0f} GiB GPU)")
    need = f"{sizes} exceed {COLOCATE_MEMORY_SHARE:.0%} of a {gpu_gib:.0f} GiB GPU"
    if gpus < 2:
        return Layout(False, 1, 1, f"{need}: a split needs at least 2 GPUs")
    best: tuple[float, int] | None = None
    for n_t in range(1, gpus):
        rate = min(n_t * target_tok_s, (gpus - n_t) * drafter_tok_s)
        if best is None or rate > best[0]:
            best = (rate, n_t)
    assert best is not None
    n_t = best[1]
    return Layout(False, n_t, gpus - n_t, f"{need}: split {n_t} target / {gpus - n_t} drafter GPU(s)")
