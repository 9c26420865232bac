"""A lying node: its agent answers ``status`` with host words that hold newlines, carriage returns, zero-width and
direction characters, to print status lines of its own (``[node] node 1: run ... running``) or make ``r​m`` read
as ``rm``. The human output of ``status`` over several nodes keeps every host word on its own line, each invisible
or direction character shown as an escape. The stand-in agent is started by the real LocalTransport in place of
the interpreter (``--python``), one per node."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import protocol

RUN_ID = "20261201-000000-abcd"
FORGED = "  [local#2] node 1: run 20261201-000000-abcd running step 99"
CAUSE = f"boom\n{FORGED}\r\n{FORGED} r\u200bm \u202egnp.exe\x85x"

LIAR = r"""#!{python}
import json, sys
out = sys.stdout.buffer
def send(obj):
    out.write(json.dumps(obj).encode() + b"\n")
    out.flush()
send({{"ev": "hello", "protocol": {protocol}, "agent_version": "liar", "hostname": "h", "pid": 1, "python": "3",
      "capabilities": {{}}}})
run = {{"run_id": {run_id!r}, "run_dir": "/r", "state": "failed", "cause": {cause!r}, "last_step": 3}}
for line in sys.stdin.buffer:
    cmd = json.loads(line)
    result = {{"host": {{}}, "gpus": [], "processes": {{"run_tree": [], "holders": []}}, "run": run, "anomalies": []}}
    send({{"ev": "reply", "id": cmd.get("id"), "ok": True, "result": result, "error": None}})
"""


def test_status_over_nodes_prints_no_line_a_lying_node_wrote_and_shows_invisible_characters(
    cli: Callable[..., Any], tmp_path: Path
) -> None:
    fake = tmp_path / "lying-agent"
    fake.write_text(LIAR.format(python=sys.executable, protocol=protocol.PROTOCOL_VERSION, run_id=RUN_ID, cause=CAUSE))
    fake.chmod(0o755)
    r = cli("status", "local", "local", "--python", str(fake), "--run-root", str(tmp_path), timeout_s=60)
    assert r.returncode == 0, r.output
    lines = r.stdout.splitlines()
    assert [ln.split("]")[0] for ln in lines if ln.startswith("  [")] == ["  [local", "  [local#2"], r.stdout
    assert not [ln for ln in lines if ln.startswith(FORGED)], r.stdout  # no line of the node's own making
    assert all("\r" not in ln and "\x85" not in ln for ln in lines)
    assert "r\\u200bm" in r.stdout and "\\u202egnp.exe" in r.stdout and "\\x85x" in r.stdout, r.stdout
    assert "\u200b" not in r.stdout and "\u202e" not in r.stdout

    as_json = cli("status", "local", "local", "--python", str(fake), "--run-root", str(tmp_path), "--json")
    assert json.loads(as_json.stdout)["nodes"][1]["status"]["run"]["cause"] == CAUSE  # --json: as sent
