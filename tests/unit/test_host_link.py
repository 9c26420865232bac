"""Under --pct the client also runs an agent on the Proxmox host and hands its map to the container's agent.

A `pct` shim on PATH stands in for Proxmox's ``pct exec CTID -- cmd``; this machine is the "node", so the host's
agent runs here (LocalTransport) and the container's through the shim, both real processes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from engine import protocol
from tui.link.events import ClientEvent
from tui.link.session import Session
from tui.link.transport import ConnectOptions, LocalTransport, Target

CTID = 4242
PCT_SHIM = """#!/bin/sh
# Stand-in for Proxmox `pct exec CTID -- cmd ...`: drops the hop and runs the command here.
[ "$1" = exec ] && [ "$2" = "{ctid}" ] && [ "$3" = -- ] || {{ echo "pct shim: bad arguments: $*" >&2; exit 255; }}
shift 3
exec "$@"
"""


@pytest.fixture
def pct_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shim_dir = tmp_path / "bin"
    shim_dir.mkdir()
    shim = shim_dir / "pct"
    shim.write_text(PCT_SHIM.format(ctid=CTID))
    shim.chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim_dir}{os.pathsep}{os.environ['PATH']}")


async def _status_over_pct(tmp_path: Path, **opts: Any) -> tuple[dict[str, Any], list[ClientEvent]]:
    options = ConnectOptions(pct=CTID, run_root=str(tmp_path / "root"), python=sys.executable, **opts)
    session = Session(LocalTransport(Target(local=True), options), options)
    events: list[ClientEvent] = []
    session.add_event_listener(events.append)
    try:
        await session.connect()
        status = await session.request("status", timeout_s=30.0)
    finally:
        await session.close()
    return status, events


async def test_status_under_pct_is_made_from_the_hosts_map(pct_on_path: None, tmp_path: Path) -> None:
    status, events = await _status_over_pct(tmp_path, simulate_gpus=2)
    assert status["host_map"]["state"] == "ok", status["host_map"]
    assert status["host_map"]["ctid"] == str(CTID)
    assert status["holders_source"]["source"] == "host-nvml"
    assert not [e for e in events if isinstance(e, protocol.WarningEvent)]


async def test_a_host_without_nvml_is_said_once_and_the_container_view_stays_labelled(
    pct_on_path: None, tmp_path: Path
) -> None:
    status, events = await _status_over_pct(tmp_path)  # no driver on this machine: the host's NVML cannot start
    state = status["host_map"]
    assert state["state"] == "unavailable" and "cannot list GPU processes" in state["detail"], state
    warnings = [e.message for e in events if isinstance(e, protocol.WarningEvent)]
    assert len(warnings) == 1 and "showing the container's own view" in warnings[0]
    assert status["holders_source"]["source"] != "host-nvml"
