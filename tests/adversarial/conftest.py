"""Fixtures for the adversarial suite: the real sshd and CLI fixtures of tests/integration, reused.

tests/integration/conftest.py belongs to CLIENT and is not moved: it is loaded here under its own module
name and its ``sshd`` and ``cli`` fixtures are re-exported, so these tests run against the same real
OpenSSH server on 127.0.0.1 (with the `pct` shim on its PATH). tests/conftest.py (the private tmux socket,
``run_root``) applies here as everywhere.
"""

from __future__ import annotations

import gc
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

# Deeply nested JSON (a fuzz input here) raises RecursionError inside json; on CPython 3.11.7 a later ast.parse
# in the same process can then fail with "AST constructor recursion depth mismatch". pytest rewrites (ast.parse)
# the hypothesis plugin's modules when it first imports them, at the terminal summary when no test imported
# hypothesis before: import it now, before any such input is parsed.
import hypothesis  # noqa: F401
import pytest

_INTEGRATION_CONFTEST = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"


def _load_integration_fixtures() -> object:
    name = "specdec_integration_fixtures"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _INTEGRATION_CONFTEST)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


_fx = _load_integration_fixtures()
sshd = _fx.sshd  # type: ignore[attr-defined]
cli = _fx.cli  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _collect_garbage_between_tests() -> Iterator[None]:
    """Finalizers (an asyncio task's "exception was never retrieved" log, with its traceback) run here, between
    tests: run by a GC pass in the middle of pytest's own ast.parse they re-enter it, and CPython 3.11.7 then
    fails that parse with "AST constructor recursion depth mismatch" (an INTERNALERROR for the whole session)."""
    yield
    gc.collect()
