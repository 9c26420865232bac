"""Engine events: the one contract of <run_dir>/events.jsonl, and the ``event`` of an agent's ``engine`` line.

One JSON object per line, written by engine/trainer, read by the agent's anomalies, the supervisor's scanner
and the dashboard: one dataclass per ``kind`` (its KIND), its fields the keys, ``t`` the unix time; a torchrun
rank tags each with rank, node and world_size. ``encode_engine_event`` writes one, ``decode_engine_event``
reads one back (chosen by its ``kind``), ``decode_engine_line`` reads a line of the file or skips it.
"""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Union

from engine.protocol.typed_json import decode_as
from engine.protocol.wire import ProtocolError, to_jsonable

# A draft vocabulary holding less of the trained tokens than this leaves the drafter unable to propose the rest.
VOCAB_COVERAGE_WARN = 0.90


@dataclass
class StageEvent:
    """stage: "imports" | "target_loaded" | "data" | "warmup" | "training" | "checkpoint" | "stopping" | "done" |
    "distributed" (a torchrun rank joined: its pid, local rank, local world size and collective backend) |
    "fp8_agreement" (an FP8 target against the exact one, in its detail). The "data" stage's summary adds skipped
    ({reason: conversations not trained on}), heldout, truncated, bad_lines and cached; its draft-vocabulary line
    adds vocab_coverage (below VOCAB_COVERAGE_WARN the engine warns and the dashboard says so)."""

    KIND: ClassVar[str] = "stage"
    stage: str
    thread: str | None = None
    detail: str = ""
    t: float | None = None
    rank: int | None = None  # torchrun rank (every event of a rank's events file carries it)
    node: int | None = None
    world_size: int | None = None
    pid: int | None = None  # the "distributed" stage: the rank's process, its local rank and how many share the node
    local_rank: int | None = None
    local_world_size: int | None = None
    backend: str | None = None  # the "distributed" stage: "nccl" | "gloo"
    skipped: dict[str, int] | None = None  # the "data" stage: conversations not trained on, by reason
    heldout: int | None = None  # conversations held out for evaluation
    truncated: int | None = None  # conversations cut to the longest bucket
    bad_lines: list[str] | None = None  # "file:line: reason" of the first malformed lines
    cached: bool | None = None  # the tokenized data came from the cache
    vocab_coverage: float | None = None  # share of the trained (loss-masked) tokens the draft vocabulary holds


@dataclass
class HeartbeatEvent:
    """A thread is alive: its state, step, throughput and queue depth (a hung thread's heartbeats age)."""

    KIND: ClassVar[str] = "heartbeat"
    thread: str
    state: str = "unknown"  # "starting" | "warmup" | "training" | "waiting" | "syncing" | "stopped" | "error"
    step: int | None = None
    tok_s: float | None = None
    queue_depth: int | None = None
    last_exception: str | None = None
    role: str | None = None  # "drafter" | "producer" | ...
    flags: list[str] = field(default_factory=list)  # raised by the trainer's health board: "stalled", "starving"
    beat_age_s: float | None = None  # seconds since the thread last beat, when this line was written
    t: float | None = None  # when the thread last beat (a hung thread's heartbeats age)
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class StepEvent:
    """A training step: loss and acceptance per TTT position, loss_total (the loss trained on, the log line's
    ``loss=``), tokens per second and ms per phase ({"fetch", "fwd", "bwd", "opt"})."""

    KIND: ClassVar[str] = "step"
    step: int
    thread: str | None = None
    loss: list[float | None] = field(default_factory=list)  # per TTT position (None: not finite)
    acc: list[float | None] = field(default_factory=list)
    loss_total: float | None = None  # sum_i 0.8**i * loss_i: the loss trained on
    tok_s: float | None = None
    # Tokens inside conversations a second, padding left out; None when the batch had no padding (== tok_s).
    useful_tok_s: float | None = None
    ms: dict[str, float | None] = field(default_factory=dict)
    grad_norm: float | None = None  # before clipping; None when the step was skipped (not finite)
    skipped: bool = False  # non-finite gradients: the optimizer did not step
    lr: float | None = None
    bucket: int | None = None  # the padded sequence length of the batch
    # The producer's host time for the batch that was trained: reading it, moving it and the target's forward. On
    # CUDA that is mostly the time to queue the forward's kernels, not their run time (bench_engine's profile has that).
    target_ms: float | None = None
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class ThreadErrorEvent:
    """A thread died of an exception; ``policy`` says whether the run stops or continues without it."""

    KIND: ClassVar[str] = "thread_error"
    thread: str
    exc_type: str = "Error"
    message: str = ""
    traceback: str | None = None
    policy: str = "stop"  # "stop" | "continue"
    role: str | None = None  # "drafter" | "producer" | ...
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class CheckpointEvent:
    """A checkpoint was written."""

    KIND: ClassVar[str] = "checkpoint"
    step: int
    path: str
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class RunEndEvent:
    """The run ended (ok, or why not)."""

    KIND: ClassVar[str] = "run_end"
    ok: bool
    reason: str = ""
    step: int | None = None
    degraded: list[str] | None = None  # threads that died under the ``continue`` policy (the run went on without them)
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class CompileEvent:
    """A recompile after warm-up or a fallback to eager (the guard of engine/trainer)."""

    KIND: ClassVar[str] = "compile"
    what: str  # "recompile" | "fallback"
    function: str | None = None
    thread: str | None = None
    graphs: int | None = None
    limit: int | None = None
    signature: str | None = None
    # A recompile of an input signature compiled before: the guard of that graph that failed (dynamo's words,
    # e.g. "8193 <= x.size()[0]": traced at a count above 8192, called with one below); None for a new signature or
    # where dynamo gave none.
    guard: str | None = None
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class ExportEvent:
    """``specdec-train export`` wrote a servable drafter (appended after the run too)."""

    KIND: ClassVar[str] = "export"
    path: str
    checkpoint: str | None = None
    step: int | None = None
    format: str | None = None
    drafter: str | None = None
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class EvalEvent:
    """Acceptance on held-out prompts: tau (mean tokens per target forward in greedy chain speculation), k,
    per_position [P(draft token j accepted), j = 1..k], per_position_conditional [P(j accepted | j-1 accepted)],
    rounds, prompts, new_tokens; or ``error`` when the evaluation failed."""

    KIND: ClassVar[str] = "eval"
    thread: str
    step: int
    tau: float | None = None
    k: int | None = None
    per_position: list[float | None] = field(default_factory=list)
    per_position_conditional: list[float | None] = field(default_factory=list)
    rounds: int | None = None
    prompts: int | None = None
    new_tokens: int | None = None
    counting: str | None = None  # how a round's accepted tokens are counted: "stop" | "vllm"
    accepted_per_position: list[int] = field(default_factory=list)  # rounds whose proposal j was accepted
    accepted_hist: list[int] = field(default_factory=list)  # [rounds that accepted exactly a tokens, a = 0..k]
    eval_s: float | None = None  # how long the evaluation took
    error: str | None = None  # the evaluation failed (then no tau)
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class NonFiniteGradEvent:
    KIND: ClassVar[str] = "nonfinite_grad"
    thread: str
    step: int
    grad_norm: str = "nan"  # "nan" | "inf": JSON has no such numbers
    in_a_row: int = 1  # skipped steps in a row, this one included
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


@dataclass
class ServedEvent:
    """A run's export served by vLLM with its target (``specdec-train serve-check``): vLLM's acceptance length
    ``tau`` and per-position rates P(draft token j accepted) on the run's held-out prompts, next to ours on the same
    prompt ids in the same (vLLM's) counting, ``tau_ours``; or ``error`` (vLLM absent or failed)."""

    KIND: ClassVar[str] = "served"
    export: str | None = None  # the export directory served
    step: int | None = None  # the checkpoint's step
    k: int | None = None
    tau: float | None = None  # vLLM's
    tau_ours: float | None = None
    per_position: list[float | None] = field(default_factory=list)
    prompts: int | None = None
    outputs_equal: int | None = None  # prompts whose speculative output equals the target's greedy one
    vllm: str | None = None  # its version
    error: str | None = None
    t: float | None = None
    rank: int | None = None
    node: int | None = None
    world_size: int | None = None


# Union[...], not X | Y: evaluated when the module loads, on hosts whose python3 may predate 3.10.
EngineEvent = Union[  # noqa: UP007
    StageEvent,
    HeartbeatEvent,
    StepEvent,
    ThreadErrorEvent,
    CheckpointEvent,
    RunEndEvent,
    CompileEvent,
    ExportEvent,
    EvalEvent,
    NonFiniteGradEvent,
    ServedEvent,
]

# The kinds, derived from the dataclasses: a kind is written once, as its class's KIND.
ENGINE_EVENT_KINDS: tuple[str, ...] = tuple(cls.KIND for cls in typing.get_args(EngineEvent))
ENGINE_EVENT_TYPES: dict[str, type[Any]] = {cls.KIND: cls for cls in typing.get_args(EngineEvent)}


def decode_engine_event(obj: Any) -> EngineEvent:
    """One line of events.jsonl (parsed) as its dataclass, chosen by ``kind``; raises ProtocolError."""
    decoded: EngineEvent = decode_as(EngineEvent, obj, "event")
    return decoded


def encode_engine_event(ev: EngineEvent) -> dict[str, Any]:
    """The JSON object of an engine event, as a line of events.jsonl holds it (``decode_engine_event``'s inverse):
    ``kind`` first, then the fields, less those that are None by default and None now."""
    out: dict[str, Any] = {"kind": ev.KIND}
    for f in fields(ev):
        value = getattr(ev, f.name)
        if value is None and f.default is None:
            continue
        out[f.name] = to_jsonable(value)
    return out


def decode_engine_line(line: bytes | str) -> EngineEvent | None:
    """One line of events.jsonl as its engine event; None for a line that is not one (torn, of an unknown kind, a
    field of the wrong type): a reader of the file skips it, as the dashboard skips it on the wire."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    try:
        return decode_engine_event(obj)
    except ProtocolError:
        return None
