"""What a process imported: a few lines of Python run in a fresh interpreter at the repository root, and which of the
packages watched had a module in ``sys.modules`` when it exited (a ``sys.exit`` included), as the process's last
line of stdout. Pins "the config error comes before torch loads" by what was loaded, not by how long it took."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")  # what the trainer imports only once its config holds
MARK = "modules loaded at exit: "

# Printed at interpreter exit, after the code's own output and after a SystemExit has set the exit status.
_AT_EXIT = """\
import atexit, json, sys
atexit.register(lambda: print({mark!r} + json.dumps(sorted(
    {{m.split(".")[0] for m in sys.modules}} & {watched!r}
)), flush=True))
"""


@dataclass(frozen=True)
class Imported:
    returncode: int
    stdout: str  # the code's own output, without the line this probe adds
    stderr: str
    loaded: list[str]  # the watched packages with a module in sys.modules at exit


def imported_by(code: str, watched: tuple[str, ...] = HEAVY, timeout_s: float = 60.0) -> Imported:
    """Runs ``code`` with ``python -c`` (the repository on PYTHONPATH, no run dir in the environment) and says what
    of ``watched`` it left loaded."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("SPECDEC_RUN_DIR", None)
    probe = _AT_EXIT.format(mark=MARK, watched=set(watched)) + code
    done = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=timeout_s, check=False,
    )  # fmt: skip
    head, sep, tail = done.stdout.rpartition(MARK)
    assert sep, f"the probe printed nothing at exit (rc {done.returncode}): {done.stderr[-2000:]}"
    return Imported(done.returncode, head, done.stderr, json.loads(tail))


def specdec_train(*args: str) -> str:
    """The code ``specdec-train ARGS`` runs, as its console script does (main's return value is the exit status)."""
    return f"import sys\nfrom engine.trainer.__main__ import main\nsys.exit(main({list(args)!r}))\n"
