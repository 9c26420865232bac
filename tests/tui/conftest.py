"""Fixtures for the dashboard tests: a private config dir, recorded-event apps, a real local agent."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.supervisor import records
from tui.dashboard.app import DashboardApp


@pytest.fixture(autouse=True)
def tui_config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test writes its theme choice and reads its key remaps in its own config dir."""
    directory = tmp_path / "config"
    monkeypatch.setenv("SPECDEC_TUI_CONFIG_DIR", str(directory))
    monkeypatch.delenv("TMUX", raising=False)
    return directory


@pytest.fixture
def local_session_factory(run_root: Path) -> Callable[..., Any]:
    """A real session to a real local agent (simulated GPUs, temp run root, private tmux socket)."""
    from tui.link.session import open_session
    from tui.link.transport import ConnectOptions

    def make(simulate_gpus: int = 2) -> Any:
        opts = ConnectOptions(run_root=str(run_root), simulate_gpus=simulate_gpus, python=sys.executable)
        return open_session("local", opts)

    return make


@pytest.fixture
async def recorded_app() -> AsyncIterator[Callable[..., DashboardApp]]:
    """Build an app on a RecordingSession (flushes by hand, fixed clock)."""
    from tui_recorded import T0

    def make(session: Any, **kwargs: Any) -> DashboardApp:
        kwargs.setdefault("flush_interval_s", None)
        kwargs.setdefault("clock", lambda: T0 + 41.5)
        kwargs.setdefault("connect", False)
        return DashboardApp(session, **kwargs)

    yield make


@pytest.fixture
def cleanup_runs() -> Iterator[list[dict[str, Any]]]:
    """Runs a test leaves alive on purpose are ended here, by the process groups their launch.json records."""
    runs: list[dict[str, Any]] = []
    yield runs
    sock = os.environ["SPECDEC_TMUX_SOCKET"]
    for run in runs:
        launch = records.read_json(Path(run["run_dir"]) / records.LAUNCH_JSON) or {}
        for key in ("job_pgid", "pgid"):  # the job has its own session; the wrapper another
            pgid = launch.get(key)
            if isinstance(pgid, int) and pgid > 1:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)
        if run.get("tmux_session"):
            subprocess.run(["tmux", "-L", sock, "kill-session", "-t", run["tmux_session"]], capture_output=True)
