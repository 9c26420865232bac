"""Injection: run names, paths, commands and profile values with quotes, ';', '$()', backticks, newlines and
spaces reach the host literally, through SSH and through the `pct` hop, and nothing else runs.

Every injected fragment would, if any shell interpreted it, create a canary file under $HOME (the one
expansion available to every shell on the host); the job reports the argv, working directory and
environment it got, and they must equal what was given. CLIENT's tests cover plain argv over SSH
(tests/integration/test_ssh.py); these add paths, the run root, profile values and run names.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from adv_support import ssh_options

from engine.supervisor import records
from tui.link.session import CommandFailed, open_session

pytestmark = [pytest.mark.ssh, pytest.mark.tmux]

HOME = Path(os.path.expanduser("~"))
CANARY_PREFIX = ".specdec-adversarial-canary-"


def nasty(tag: str) -> str:
    """A string with every metacharacter; each command in it would create a canary named after ``tag``."""
    c = f"$HOME/{CANARY_PREFIX}{tag}"
    return f"a 'q' \"dq\" ; touch {c}-semi ; $(touch {c}-dollar) `touch {c}-tick` | touch {c}-pipe & \\ *\nnl"


REPORT = (
    "import json, os, sys\n"
    "print(json.dumps({'argv': sys.argv[1:], 'cwd': os.getcwd(), 'env': os.environ.get('NASTY')}), flush=True)\n"
    "print('step=1', flush=True)\n"
)


def _canaries() -> list[Path]:
    return sorted(HOME.glob(CANARY_PREFIX + "*"))


@pytest.fixture(autouse=True)
def no_canaries() -> Iterator[None]:
    for c in _canaries():
        c.unlink()
    yield
    found = _canaries()
    for c in found:
        c.unlink()
    assert not found, f"an injected command ran: {found}"


def _report(run_root: Path, stdout: str) -> dict[str, Any]:
    run_id = json.loads(stdout)["run_id"]
    first = (records.run_dir_for(run_root, run_id) / records.OUTPUT_LOG).read_text().splitlines()[0]
    out: dict[str, Any] = json.loads(first)
    return out


@pytest.mark.parametrize("hop", ["ssh", "ssh+pct"])
def test_paths_commands_and_profile_values_reach_the_host_literally(
    sshd: Any, cli: Callable[..., Any], tmp_path: Path, hop: str
) -> None:
    # The run root and the working directory are paths full of metacharacters (a newline included).
    run_root = tmp_path / ("root " + nasty("root").replace("/", "#"))
    run_root.mkdir()
    cwd = tmp_path / ("cwd " + nasty("cwd").replace("/", "#"))
    cwd.mkdir()
    args = [nasty("arg1"), nasty("arg2"), "", " ", "-c", "--", "\t"]
    config = tmp_path / "profiles.toml"
    config.write_text(
        "[profiles.nasty]\n"
        f"command = {json.dumps([sys.executable, '-c', REPORT, *args])}\n"
        f"cwd = {json.dumps(str(cwd))}\n"
        f"env = {{ NASTY = {json.dumps(nasty('env'))} }}\n"
    )
    pct = ["--pct", str(sshd.pct_ctid)] if hop == "ssh+pct" else []
    r = cli(
        "launch", sshd.target, *sshd.args(), *pct, "--run-root", str(run_root), "--config", str(config),
        "--profile", "nasty", "--wait", "first-step", "--json", "--timeout", "60",
    )  # fmt: skip
    assert r.returncode == 0, r.output
    got = _report(run_root, r.stdout)
    assert got == {"argv": args, "cwd": str(cwd), "env": nasty("env")}
    # A `-- COMMAND` on the command line, through the same hop and nasty run root.
    r2 = cli(
        "launch", sshd.target, *sshd.args(), *pct, "--run-root", str(run_root), "--wait", "first-step", "--json",
        "--timeout", "60", "--", sys.executable, "-c", REPORT, *args,
    )  # fmt: skip
    assert r2.returncode == 0, r2.output
    assert _report(run_root, r2.stdout)["argv"] == args
    status = cli("status", sshd.target, *sshd.args(), *pct, "--run-root", str(run_root), "--json")
    assert status.returncode == 0, status.output
    assert json.loads(status.stdout)["host"]["run_root"] == str(run_root)


BAD_RUN_NAMES = [
    "x; touch $HOME/" + CANARY_PREFIX + "name-semi",
    "$(touch $HOME/" + CANARY_PREFIX + "name-dollar)",
    "`touch $HOME/" + CANARY_PREFIX + "name-tick`",
    "a b",
    "a'b",
    'a"b',
    "line\nbreak",
    "../escape",
    "-leading-dash",
    "",
]


@pytest.mark.parametrize("hop", ["ssh", "ssh+pct"])
async def test_run_names_with_metacharacters_are_refused_and_create_nothing(
    sshd: Any, run_root: Path, hop: str
) -> None:
    opts = ssh_options(sshd, run_root, pct=sshd.pct_ctid if hop == "ssh+pct" else None)
    session = open_session(sshd.target, opts)
    await session.connect()
    try:
        for name in BAD_RUN_NAMES:
            with pytest.raises(CommandFailed) as err:
                await session.request("launch", timeout_s=30.0, command=["true"], run_id=name)
            assert "run id" in err.value.message.lower(), err.value.message
        # A legitimate unusual name is used literally (tmux turns '.' into '_', the run directory keeps it).
        name = f"v1.2_a-b-{'pct' if opts.pct else 'ssh'}"
        ok = await session.request("launch", timeout_s=30.0, command=["true"], run_id=name)
        assert ok["run_id"] == name and Path(ok["run_dir"]).name == name
    finally:
        await session.close()
    assert [p.name for p in (run_root / "runs").iterdir()] == [name]
