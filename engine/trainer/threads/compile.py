"""The compile guard: torch.compile is not thread-safe, so everything that can trace or compile runs under one lock.

Measured on an H200 with torch 2.11: three threads compiling flex_attention at once hang with no output;
under one process-wide lock around the first call they finish in 4.5 s. The guard takes the lock around
the first call of every compiled function for every new input signature (a first call may trace, a new
shape may recompile), around block-mask creation, and around each thread's warm-up (forward and backward
of every length bucket, so the lazily compiled backward is built under the lock too). Once warm, calls
with a known signature run without the lock. ``set_guard_enabled(False)`` exists only for the control
experiment that shows what happens without it.

Compile events: dynamo keeps one graph per input signature of a compiled function (per length bucket, TTT
step, device and grad mode here) up to its recompile limit, then silently runs that function eagerly for
every new signature. ``recompile_limit_for`` sizes the limit from the run, and a ``GuardedFunction`` reports
to its listeners (the engine writes them as ``compile`` events) every graph compiled after the calling
thread called ``mark_warm`` ("recompile") and every new signature left to eager because the limit was hit
("fallback"), counted from dynamo's cache entries for the function's code (a few microseconds a call). A
known signature that recompiles (a guard the signature does not show) is a recompile event too; it cannot
be a fallback event (an eager run leaves no trace in the count), but its recompiles come first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_LOCK = threading.RLock()
_enabled = True
RECOMPILE_LIMIT = 64  # until the engine sizes it from the run (set_recompile_limit)
RECOMPILE_HEADROOM = 2  # the limit is this many times the graphs a run is expected to compile per function
_recompile_limit = RECOMPILE_LIMIT

CompileListener = Callable[[dict[str, Any]], None]


def recompile_limit_for(ttt_steps: int, buckets: int, devices: int) -> int:
    """Graphs a TTT step function may compile: one per (TTT step, length bucket, drafter device, grad mode:
    training and no-grad evaluation), with headroom; a fallback to eager below that is a bug to see."""
    expected = ttt_steps * buckets * devices * 2
    return max(8, RECOMPILE_HEADROOM * expected)


def set_recompile_limit(limit: int) -> None:
    """The limit every thread's ``apply_dynamo_config`` sets from now on."""
    global _recompile_limit
    _recompile_limit = int(limit)


def recompile_limit() -> int:
    return _recompile_limit


def set_guard_enabled(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def guard_enabled() -> bool:
    return _enabled


@contextlib.contextmanager
def compile_guard() -> Iterator[None]:
    """Hold the process-wide compile lock (a no-op when the guard is disabled for the control run)."""
    if _enabled:
        with _LOCK:
            yield
    else:
        yield


def apply_dynamo_config() -> None:
    """Dynamo settings; from torch 2.12 they are per thread, so every thread calls this before any compile."""
    try:
        import torch._dynamo as dynamo
    except ImportError:  # pragma: no cover - torch without dynamo
        return
    cfg: Any = dynamo.config
    limit = _recompile_limit
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, limit)
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * limit)
    if hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 8 * limit)
    # Fixed length buckets: no dynamic shapes, one graph per bucket and TTT step.
    if hasattr(cfg, "automatic_dynamic_shapes"):
        cfg.automatic_dynamic_shapes = False
    if hasattr(cfg, "assume_static_by_default"):
        cfg.assume_static_by_default = True


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype, str(value.device), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    seq = getattr(value, "seq_lengths", None)  # flex BlockMask
    if seq is not None:
        return ("BlockMask", tuple(seq), id(value))
    return type(value).__name__


def _dynamo_limit() -> int:
    """This thread's dynamo recompile limit (per thread from torch 2.12)."""
    import torch._dynamo as dynamo

    cfg: Any = dynamo.config
    limit = getattr(cfg, "recompile_limit", None) or getattr(cfg, "cache_size_limit", None)
    return int(limit) if limit is not None else _recompile_limit


def _graph_counter(fn: Callable[..., Any]) -> Callable[[], int] | None:
    """How many graphs dynamo holds for ``fn``'s code (a function's, or a module's ``forward``), or None."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "forward", None), "__code__", None)
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - a torch without the cache-entry view: no compile events
        return None
    if code is None:
        return None
    return lambda: len(_debug_get_cache_entry_list(code))


def _describe(key: Any) -> str:
    """A short text for an input signature: its tensor shapes and plain values (what changed is visible)."""
    parts: list[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, tuple) and v and v[0] == "T":
            parts.append("x".join(str(d) for d in v[1]) or "scalar")
        elif isinstance(v, tuple):
            for x in v:
                walk(x)
        elif isinstance(v, (int, float, bool)) or v is None:
            parts.append(repr(v))

    walk(key)
    text = " ".join(parts)
    return text if len(text) <= 160 else text[:157] + "..."


class _FirstCallCount:
    """Guarded first calls (which may compile) started so far and running now, across all functions."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.started = 0
        self.running = 0

    def __enter__(self) -> None:
        with self._lock:
            self.started += 1
            self.running += 1

    def __exit__(self, *_exc: object) -> None:
        with self._lock:
            self.running -= 1

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.started, self.running


_FIRST_CALLS = _FirstCallCount()


class GuardedFunction:
    """A (possibly compiled) function whose first call per input signature runs under the compile guard.

    ``listeners`` get a dict per compile event (``what``: "recompile" or "fallback", ``function``,
    ``thread``, ``graphs``, ``limit``, ``signature``); ``backend`` is torch.compile's (tests use "eager").
    """

    def __init__(self, fn: Callable[..., Any], *, compiled: bool, name: str, backend: str = "inductor") -> None:
        self.name = name
        self.compiled = compiled
        self._fn = torch.compile(fn, dynamic=False, backend=backend) if compiled else fn
        self._seen: set[Any] = set()
        self._seen_lock = threading.Lock()
        self._graphs = _graph_counter(fn) if compiled else None
        self._warm: set[tuple[int, bool]] = set()  # (thread ident, grad mode) pairs that finished warm-up
        self._fell_back = False
        self.listeners: list[CompileListener] = []
        self.events: list[dict[str, Any]] = []

    def graph_count(self) -> int | None:
        """Graphs dynamo holds for this function's code (None when not compiled or not countable)."""
        return self._graphs() if self._graphs is not None else None

    def mark_warm(self) -> None:
        """From now on a graph compiled in the calling thread, in the current grad mode, is a recompile after
        warm-up (an event); a first no-grad call after a training warm-up (evaluation) is not."""
        with self._seen_lock:
            self._warm.add((threading.get_ident(), torch.is_grad_enabled()))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.compiled:
            return self._fn(*args, **kwargs)
        key = (torch.is_grad_enabled(), _signature(args), _signature(kwargs))
        with self._seen_lock:
            known = key in self._seen
        if known:
            return self._call_known(key, args, kwargs)
        with compile_guard(), _FIRST_CALLS:
            before = self._graphs() if self._graphs is not None else None
            out = self._fn(*args, **kwargs)
            if before is not None and self._graphs is not None:
                self._after_new_signature(key, before, self._graphs())
        with self._seen_lock:
            self._seen.add(key)
        return out

    def _call_known(self, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A known signature can still recompile (a guard it does not show, e.g. two arguments that were one
        tensor at warm-up): count graphs around warm calls, unless another thread's first call ran meanwhile."""
        if self._graphs is None or (threading.get_ident(), key[0]) not in self._warm:
            return self._fn(*args, **kwargs)
        first_calls = _FIRST_CALLS.snapshot()
        before = self._graphs()
        out = self._fn(*args, **kwargs)
        after = self._graphs()
        if after > before and first_calls == _FIRST_CALLS.snapshot() and first_calls[1] == 0:
            self._report("recompile", key, after, _dynamo_limit())
        return out

    def _after_new_signature(self, key: Any, before: int, after: int) -> None:
        limit = _dynamo_limit()
        warm = (threading.get_ident(), key[0]) in self._warm
        if after > before and warm:
            what = "recompile"
        elif after == before and after >= limit and not self._fell_back:
            what = "fallback"  # dynamo hit its limit: this signature (and every later new one) runs eagerly
            self._fell_back = True
        else:
            return  # a first compile during warm-up, or a new signature that an existing graph's guards accept
        self._report(what, key, after, limit)

    def _report(self, what: str, key: Any, graphs: int, limit: int) -> None:
        event = {
            "what": what,
            "function": self.name,
            "thread": threading.current_thread().name,
            "graphs": graphs,
            "limit": limit,
            "signature": _describe(key),
        }
        self.events.append(event)
        for listener in list(self.listeners):
            listener(event)
