"""Shared fixtures: a private tmux server per test session, and a temporary run root. Helpers every suite
shares (the agent client, the one bounded wait) live in tests/support.

Every tmux call in product code adds ``-L $SPECDEC_TMUX_SOCKET`` when that variable is set; it is
set here, before any test runs, so no test ever touches the user's default tmux server. The
private server is killed at the end of the session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TMUX_SOCKET = f"specdec-test-{os.getpid()}"
os.environ["SPECDEC_TMUX_SOCKET"] = TMUX_SOCKET


@pytest.fixture(scope="session", autouse=True)
def tmux_socket() -> Iterator[str]:
    """The private tmux socket name (``tmux -L NAME``) of this test session; its server dies at teardown."""
    os.environ["SPECDEC_TMUX_SOCKET"] = TMUX_SOCKET
    yield TMUX_SOCKET
    if shutil.which("tmux"):
        subprocess.run(["tmux", "-L", TMUX_SOCKET, "kill-server"], capture_output=True, timeout=10, check=False)


@pytest.fixture
def run_root(tmp_path: Path) -> Path:
    """An empty run root (``--run-root``) for one test."""
    root = tmp_path / "run-root"
    root.mkdir()
    return root


@pytest.fixture(scope="session")
def python_exe() -> str:
    """The interpreter that has the project's dependencies (pass it as ``--python`` to hosts)."""
    return sys.executable


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs of its own, for a disk that fills up (root can mount one here; anyone else gets a skip)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs needs root (CI runs as root); a loop device would need root too")
    mnt = tmp_path / "tiny-fs"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
