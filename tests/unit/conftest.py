"""Fixtures for the unit tests that talk to a real agent subprocess (test_agent_*.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.agent import AgentClient


@pytest.fixture
def agent(run_root: Path) -> Iterator[AgentClient]:
    """An agent with 8 simulated GPUs on this test's run root, closed at teardown."""
    a = AgentClient(run_root, simulate_gpus=8)
    yield a
    a.close()
