"""The compile guard: torch.compile is not thread-safe, so nothing runs compiled code while a thread traces or compiles.

Measured on an H200 with torch 2.11: three threads compiling flex_attention at once hang with no output;
under one process-wide lock around the first call they finish in 4.5 s. A lock around first calls alone is
not enough: dynamo evaluates a compiled function's guards in the calling thread, and its relational guards
(that no two tensor inputs alias) keep their state in the guard tree that every thread calling the function
shares. Three drafter threads calling one compiled TTT step at once make that check fail now and then
("Unexpected recompilation: runtime guards failed even though they passed during recompilation-reason
analysis"), so a thread recompiled the step after warm-up while the others ran compiled code, and one of
them died in FX ("Detected that you are using FX to symbolically trace a dynamo-optimized function").

So the guard is a readers-writer lock (``CompileLock``): every call of a compiled function holds it shared,
tracing and compiling hold it alone. While any thread holds it shared, dynamo's stance is
``fail_on_recompile``: a call whose guards fail raises before tracing anything instead of compiling in
company. The call is then repeated holding the lock alone: alone, a spuriously failed guard passes and the
existing graph runs (a "retry", counted, no graph compiled); a real change of signature compiles, exclusively
(a "recompile" event when the thread was warm). The lock is held alone around the first call of every new
input signature (a first call may trace), around block-mask creation and around each thread's warm-up
(forward and backward of every length bucket; backward graphs are lowered with their forward, not lazily
at the first backward, so they are built under the lock too). ``set_guard_enabled(False)`` exists only for
the control experiment that shows what happens without it.

Compile events: dynamo keeps one graph per input signature of a compiled function (per length bucket, TTT
step, device and grad mode here) up to its recompile limit, then silently runs that function eagerly for
every new signature. ``recompile_limit_for`` sizes the limit from the run, and a ``GuardedFunction`` reports
to its listeners (the engine writes them as ``compile`` events) every graph compiled after the calling
thread called ``mark_warm`` ("recompile") and every new signature left to eager because the limit was hit
("fallback"), counted from dynamo's cache entries for the function's code. A recompile of an input signature
that already had a graph (a dimension marked dynamic keeps one signature for every size) names the guard of that
graph that failed (``CompileEvent.guard``, from dynamo's record of guard failures), so its cause is on the screen.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.protocol import CompileEvent

_enabled = True
RECOMPILE_LIMIT = 64  # until the engine sizes it from the run (set_recompile_limit)
RECOMPILE_HEADROOM = 2  # the limit is this many times the graphs a run is expected to compile per function
_recompile_limit = RECOMPILE_LIMIT

CompileListener = Callable[[CompileEvent], None]


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


# Dynamo's refusal reads "Detected recompile when torch.compile stance is 'fail_on_recompile'. ..." (2.6 to 2.13).
RECOMPILE_REFUSED = "stance is 'fail_on_recompile'"


def _set_stance(stance: str) -> None:
    torch.compiler.set_stance(stance)


class CompileLock:
    """Readers-writer lock: compiled calls share it, tracing and compiling hold it alone; reentrant per thread.

    A waiting writer keeps new readers out (three threads calling compiled code back to back would starve
    it). While readers hold it dynamo's stance is ``fail_on_recompile`` (the stance is process-wide; it changes
    only when the first reader enters or the last leaves, so no compiled call is running when it does).
    """

    def __init__(self, set_stance: Callable[[str], None] = _set_stance) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer: int | None = None  # thread ident holding it alone
        self._writer_depth = 0
        self._writers_waiting = 0
        self._readers_waiting = 0
        self._reads = threading.local()  # .depth: this thread's nested shared holds
        self._lent_by: int | None = None  # the writer waiting on other threads that work for it (a backward)
        self._set_stance = set_stance

    def _read_depth(self) -> int:
        return int(getattr(self._reads, "depth", 0))

    def held_alone(self) -> bool:
        """The calling thread holds the lock alone, or works for the thread that does and lent it."""
        me = threading.get_ident()
        with self._cond:
            return self._writer == me or (self._lent_by is not None and self._lent_by == self._writer)

    def readers(self) -> int:
        with self._cond:
            return self._readers

    def readers_waiting(self) -> int:
        with self._cond:
            return self._readers_waiting

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._writer_depth += 1
            else:
                if self._read_depth():
                    raise RuntimeError("compile lock: a thread inside a compiled call cannot trace or compile")
                self._writers_waiting += 1
                try:
                    while self._writer is not None or self._readers:
                        self._cond.wait()
                finally:
                    self._writers_waiting -= 1
                self._writer, self._writer_depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._writer_depth -= 1
                if self._writer_depth == 0:
                    self._writer = None
                    self._cond.notify_all()

    @contextlib.contextmanager
    def lending(self) -> Iterator[None]:
        """The writer blocks on threads working for it (a backward on CUDA's autograd threads recomputing
        checkpointed compiled steps): their compiled calls run under its hold instead of waiting for it."""
        me = threading.get_ident()
        with self._cond:
            if self._writer != me:
                raise RuntimeError("compile lock: only the thread holding it alone can lend it")
            outer, self._lent_by = self._lent_by, me
        try:
            yield
        finally:
            with self._cond:
                self._lent_by = outer

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            if self._writer == me or (self._lent_by is not None and self._lent_by == self._writer):
                shared = False  # alone already, or working for the thread that is
            else:
                shared = True
                if not self._read_depth():  # a nested read must not wait behind a writer that waits for it
                    self._readers_waiting += 1
                    try:
                        while self._writer is not None or self._writers_waiting:
                            self._cond.wait()
                    finally:
                        self._readers_waiting -= 1
                    self._readers += 1
                    if self._readers == 1:
                        self._set_stance("fail_on_recompile")
                self._reads.depth = self._read_depth() + 1
        try:
            yield
        finally:
            if shared:
                with self._cond:
                    self._reads.depth -= 1
                    if not self._reads.depth:
                        self._readers -= 1
                        if self._readers == 0:
                            self._set_stance("default")
                            self._cond.notify_all()


_LOCK = CompileLock()


@contextlib.contextmanager
def compile_guard() -> Iterator[None]:
    """Hold the compile lock alone (a no-op when the guard is disabled for the control run)."""
    if _enabled:
        with _LOCK.writing():
            yield
    else:
        yield


def compile_lock() -> CompileLock:
    return _LOCK


@contextlib.contextmanager
def lending_guard() -> Iterator[None]:
    """Inside ``compile_guard``: let the threads this one waits on (a backward's) call compiled code."""
    if _enabled:
        with _LOCK.lending():
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
    try:
        import torch._functorch.config as functorch_config
    except ImportError:  # pragma: no cover - torch without functorch
        return
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        # The backward graph is lowered with its forward, under the lock, not at a first backward outside it.
        functorch_config.force_non_lazy_backward_lowering = True


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        # A dimension marked dynamic (torch._dynamo.mark_dynamic: draft/rows.py's row counts) is one graph for every
        # size, so one signature: "*", not the size of the call.
        dynamic = getattr(value, "_dynamo_dynamic_indices", ())
        shape = tuple("*" if i in dynamic else d for i, d in enumerate(value.shape))
        stride = tuple("*" if dynamic else d for d in value.stride())
        return ("T", shape, stride, value.dtype, str(value.device), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _signature(v)) for k, v in value.items()))
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    seq = getattr(value, "seq_lengths", None)  # flex BlockMask
    if seq is not None:
        # By shape and mask code, not identity: packed batches bring a new mask per batch (draft/masks.py); a
        # mask dynamo's guards reject is refused under the shared lock and retried alone, as any other.
        code = getattr(getattr(value, "mask_mod", None), "__code__", None)
        return ("BlockMask", tuple(seq), _signature(getattr(value, "kv_indices", None)), id(code))
    return type(value).__name__


def _dynamo_limit() -> int:
    """This thread's dynamo recompile limit (per thread from torch 2.12)."""
    import torch._dynamo as dynamo

    cfg: Any = dynamo.config
    limit = getattr(cfg, "recompile_limit", None) or getattr(cfg, "cache_size_limit", None)
    return int(limit) if limit is not None else _recompile_limit


def _code_of(fn: Callable[..., Any]) -> Any:
    """The code object dynamo caches ``fn``'s graphs under (a function's, or a module's ``forward``), or None."""
    return getattr(fn, "__code__", None) or getattr(getattr(fn, "forward", None), "__code__", None)


def _cache_entries(fn: Callable[..., Any]) -> Callable[[], list[Any]] | None:
    """A call giving dynamo's cache entries for ``fn``'s code, one per compiled graph, the newest first; None where
    this torch has no view of them (no compile events then)."""
    code = _code_of(fn)
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - a torch without the cache-entry view: no compile events
        return None
    if code is None:
        return None
    return lambda: _debug_get_cache_entry_list(code)


def _guard_failures(code: Any) -> list[str]:
    """The guard failures dynamo recorded for ``code`` so far (its own list: read, never change), one per graph
    whose guards a call failed before it compiled a new one ("0/3: <the first guard of graph 0/3 that failed>"),
    oldest first."""
    try:
        from torch._dynamo.utils import guard_failures
    except ImportError:  # pragma: no cover
        return []
    return guard_failures.get(code, [])


def failed_guard(reasons: list[str], graph_id: str | None) -> str | None:
    """Of the guard failures a recompile recorded, the one of graph ``graph_id`` (the newest graph of the same
    input signature: why it no longer fits), as one line without dynamo's source comment; None when that graph's
    is not among them."""
    if graph_id is None:
        return None
    prefix = f"{graph_id}: "
    for reason in reasons:
        if reason.startswith(prefix):
            line = reason[len(prefix) :].split("\n", 1)[0]
            line = line.split("  #", 1)[0].strip()  # dynamo appends "# file:line in function" to the guard
            return line if len(line) <= 300 else line[:297] + "..."
    return None


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


def _refused(exc: BaseException) -> bool:
    """Dynamo declined to compile because of the ``fail_on_recompile`` stance the shared lock sets."""
    return isinstance(exc, RuntimeError) and RECOMPILE_REFUSED in str(exc)


class GuardedFunction:
    """A (possibly compiled) function called under the compile lock: shared when its signature is known,
    alone for the first call of a signature and whenever dynamo wants to compile.

    ``listeners`` get a ``CompileEvent`` per graph compiled after warm-up (``what``: "recompile") or signature
    left to eager (``what``: "fallback"); ``backend`` is torch.compile's (tests use "eager").
    ``retries`` counts calls whose guards failed in company and passed alone (no graph compiled).
    """

    def __init__(self, fn: Callable[..., Any], *, compiled: bool, name: str, backend: str = "inductor") -> None:
        self.name = name
        self.compiled = compiled
        self._fn = torch.compile(fn, dynamic=False, backend=backend) if compiled else fn
        self._seen: set[Any] = set()
        self._seen_lock = threading.Lock()
        self._code = _code_of(fn) if compiled else None
        self._entries = _cache_entries(fn) if compiled else None
        self._graph_ids: dict[Any, str] = {}  # input signature -> the compile id of its newest graph
        self._warm: set[tuple[int, bool]] = set()  # (thread ident, grad mode) pairs that finished warm-up
        self._fell_back = False
        self.retries = 0
        self.listeners: list[CompileListener] = []
        self.events: list[CompileEvent] = []

    def graph_count(self) -> int | None:
        """Graphs dynamo holds for this function's code (None when not compiled or not countable)."""
        return len(self._entries()) if self._entries is not None else None

    def mark_warm(self) -> None:
        """From now on a graph compiled in the calling thread, in the current grad mode, is a recompile after
        warm-up (an event); a first no-grad call after a training warm-up (evaluation) is not."""
        with self._seen_lock:
            self._warm.add((threading.get_ident(), torch.is_grad_enabled()))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.compiled or not _enabled:
            return self._fn(*args, **kwargs)
        key = (torch.is_grad_enabled(), _signature(args), _signature(kwargs))
        with self._seen_lock:
            known = key in self._seen
        if known and not _LOCK.held_alone():
            try:
                with _LOCK.reading():
                    return self._fn(*args, **kwargs)
            except RuntimeError as exc:
                if not _refused(exc):
                    raise
                # Refused before tracing; repeating the call is safe for the pure functions guarded here.
        with contextlib.nullcontext() if _LOCK.held_alone() else _LOCK.writing():
            before = self.graph_count()
            failures = len(_guard_failures(self._code))
            out = self._fn(*args, **kwargs)
            if before is not None and self._entries is not None:
                entries = self._entries()
                reason = None
                if len(entries) > before:
                    reason = failed_guard(_guard_failures(self._code)[failures:], self._graph_ids.get(key))
                    newest = getattr(entries[0], "compile_id", None)  # the graph just made for this signature
                    if newest is not None:
                        self._graph_ids[key] = str(newest)
                self._after_call(key, known, before, len(entries), reason)
        with self._seen_lock:
            self._seen.add(key)
        return out

    def _after_call(self, key: Any, known: bool, before: int, after: int, reason: str | None = None) -> None:
        """Alone: a graph compiled by a warm thread is a recompile; a known signature that compiled nothing
        had its guards fail only in company (a retry); a new one left uncompiled at the limit, a fallback.
        ``reason``: for a known signature compiled again, the guard of its newest graph that failed."""
        limit = _dynamo_limit()
        warm = (threading.get_ident(), key[0]) in self._warm
        if after > before and warm:
            what = "recompile"
        elif after == before and known:
            with self._seen_lock:
                self.retries += 1
            return
        elif after == before and after >= limit and not self._fell_back:
            what = "fallback"  # dynamo hit its limit: this signature (and every later new one) runs eagerly
            self._fell_back = True
        else:
            return  # a first compile during warm-up, or a new signature that an existing graph's guards accept
        self._report(what, key, after, limit, reason if what == "recompile" else None)

    def _report(self, what: str, key: Any, graphs: int, limit: int, reason: str | None = None) -> None:
        event = CompileEvent(
            what=what,
            function=self.name,
            thread=threading.current_thread().name,
            graphs=graphs,
            limit=limit,
            signature=_describe(key),
            guard=reason,
        )
        self.events.append(event)
        for listener in list(self.listeners):
            listener(event)
