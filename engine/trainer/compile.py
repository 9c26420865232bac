"""The compile guard: torch.compile is not thread-safe, so everything that can trace or compile runs under one lock.

Measured on an H200 with torch 2.11: three threads compiling flex_attention at once hang with no output;
under one process-wide lock around the first call they finish in 4.5 s. The guard takes the lock around
the first call of every compiled function for every new input signature (a first call may trace, a new
shape may recompile), around block-mask creation, and around each thread's warm-up (forward and backward
of every length bucket, so the lazily compiled backward is built under the lock too). Once warm, calls
with a known signature run without the lock. ``set_guard_enabled(False)`` exists only for the control
experiment that shows what happens without it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

_LOCK = threading.RLock()
_enabled = True
RECOMPILE_LIMIT = 64


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
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, RECOMPILE_LIMIT)
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 8 * RECOMPILE_LIMIT)
    if hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 8 * RECOMPILE_LIMIT)
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


class GuardedFunction:
    """A (possibly compiled) function whose first call per input signature runs under the compile guard."""

    def __init__(self, fn: Callable[..., Any], *, compiled: bool, name: str) -> None:
        self.name = name
        self.compiled = compiled
        self._fn = torch.compile(fn, dynamic=False) if compiled else fn
        self._seen: set[Any] = set()
        self._seen_lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.compiled:
            return self._fn(*args, **kwargs)
        key = (torch.is_grad_enabled(), _signature(args), _signature(kwargs))
        with self._seen_lock:
            known = key in self._seen
        if known:
            return self._fn(*args, **kwargs)
        with compile_guard():
            out = self._fn(*args, **kwargs)
        with self._seen_lock:
            self._seen.add(key)
        return out
