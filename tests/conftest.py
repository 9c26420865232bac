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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
TMUX_SOCKET = f"specdec-test-{os.getpid()}"
os.environ["SPECDEC_TMUX_SOCKET"] = TMUX_SOCKET


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Many tiny forwards on a shared CPU: a second torch thread only adds waiting. A module takes it with
    ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``; torch's own count is put back after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """For a test that compiles the engine's ``ttt_step`` and counts its graphs: dynamo keeps compiled graphs per code
    object for the whole process, so the graphs earlier tests compiled (other shapes, FP8 or bf16) count toward the
    recompile limit, and some orders of the tests fill it (a ``fallback`` where none is). Starts from none."""
    import torch._dynamo

    torch._dynamo.reset()
    yield


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


@pytest.fixture(scope="session")
def family_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``family_dir(name)``: the tiny random model of a target family (tests/support/families.py), saved as a Hugging
    Face directory once a session."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            from support.families import build_family  # torch and transformers: only for the tests that use it

            built[name] = build_family(name, tmp_path_factory.mktemp(f"family-{name}"))
        return built[name]

    return get


FAMILY_CORPUS_CONVERSATIONS = 48


@pytest.fixture(scope="session")
def trained_family(
    tmp_path_factory: pytest.TempPathFactory, family_dir: Callable[[str], Path]
) -> Callable[[str], tuple[Path, list[dict[str, Any]]]]:
    """``trained_family(name)``: (output dir, step events) of 10 engine steps on that family, run once a session."""
    runs: dict[str, tuple[Path, list[dict[str, Any]]]] = {}

    def get(name: str) -> tuple[Path, list[dict[str, Any]]]:
        if name not in runs:
            from support.families import train_family

            from engine.trainer.data.sources import shipped_corpus_path

            data = tmp_path_factory.getbasetemp() / "family-corpus.jsonl"
            if not data.is_file():
                lines = shipped_corpus_path().read_text(encoding="utf-8").splitlines()[:FAMILY_CORPUS_CONVERSATIONS]
                data.write_text("\n".join(lines) + "\n", encoding="utf-8")
            out = tmp_path_factory.mktemp(f"trained-{name}")
            code, steps = train_family(family_dir(name), data, out)
            assert code == 0, f"{name}: the engine exited {code}"
            runs[name] = (out, steps)
        return runs[name]

    return get
