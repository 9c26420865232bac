"""The README's example commands do what the text around them says, as written."""

from __future__ import annotations

import ast
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def readme_command(starts: str) -> list[str]:
    """The README's inline `...` command that starts with ``starts`` (it may wrap across lines)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    found = re.search(rf"`({re.escape(starts)}[^`]*)`", text)
    assert found, f"no `{starts}...` in README.md"
    return shlex.split(" ".join(found.group(1).split()))


def test_the_tiny_trained_example_ends_and_writes_outside_the_checkout() -> None:
    """It ran 1,000,000 steps (the cpu-demo preset's, meant for the dashboard) into runs/ of the checkout."""
    argv = readme_command("specdec-train --preset cpu-demo --set target=tiny-trained")
    done = subprocess.run(
        [sys.executable, "-m", "engine.trainer", *argv[1:], "--print-config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    config = dict(line.split(" = ", 1) for line in done.stdout.splitlines() if " = " in line)
    assert config["target"] == "'tiny-trained'" and config["eval_every"] == "200"
    assert int(config["steps"]) <= 2000, config["steps"]
    output_dir = Path(ast.literal_eval(config["output_dir"]))  # --print-config prints a repr
    assert output_dir.is_absolute() and REPO not in output_dir.parents, output_dir
