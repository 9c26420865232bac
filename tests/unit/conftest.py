"""Fixtures of the unit tests: a real agent subprocess (test_agent_*.py) and a small slice of the shipped corpus
(the trainer's tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.agent import AgentClient


@pytest.fixture
def agent(run_root: Path) -> Iterator[AgentClient]:
    """An agent with 8 simulated GPUs on this test's run root, closed at teardown."""
    a = AgentClient(run_root, simulate_gpus=8)
    yield a
    a.close()


@pytest.fixture(scope="session")
def corpus_head(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``corpus_head(n)``: the shipped corpus's first ``n`` conversations as a file of their own."""

    def make(n: int) -> Path:
        from engine.trainer.data.sources import shipped_corpus_path  # torch: only for the tests that train

        path = tmp_path_factory.mktemp("corpus") / f"head{n}.jsonl"
        lines = shipped_corpus_path().read_text(encoding="utf-8").splitlines()[:n]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    return make


@pytest.fixture(scope="module")
def small_corpus(corpus_head: Callable[[int], Path]) -> Path:
    """64 conversations: a few epochs' worth for the tiny engine."""
    return corpus_head(64)
