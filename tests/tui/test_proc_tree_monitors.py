"""Monitors are not holders: a process with /dev/nvidia* open and no GPU context (absent from NVML's process
lists: nvidia-smi, nvitop, DCGM, an agent reading NVML) is shown as a monitor, never as a stale holder; the
pane's own agent is not listed at all. Real processes hold a fake /dev/nvidia* (SPECDEC_DEV_DIR)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from textual.app import App, ComposeResult

from engine.host.holders import NvmlView, find_holders
from engine.protocol import ProcsEvent
from tui.dashboard.widgets.proc_tree import ProcTree, ThreadHealthModel


class _Pane(App[None]):
    def compose(self) -> ComposeResult:
        yield ProcTree(ThreadHealthModel(), clock=lambda: 100.0, id="procs")


async def test_a_device_holder_without_a_context_is_a_monitor_not_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidiactl"):
        (dev / name).write_bytes(b"")
    monkeypatch.setenv("SPECDEC_DEV_DIR", str(dev))
    fds = [os.open(dev / n, os.O_RDONLY) for n in ("nvidia0", "nvidiactl")]  # this process: the agent's share
    try:
        compute = subprocess.Popen(["sleep", "60"], pass_fds=fds)
        monitor = subprocess.Popen(["sleep", "60"], pass_fds=fds)
        try:
            view = NvmlView(pid_used_mib={compute.pid: 8192.0}, pid_gpus={compute.pid: [0]}, source="nvml")
            found = find_holders(str(dev), view)
        finally:
            for p in (compute, monitor):
                p.kill()
                p.wait()
    finally:
        for fd in fds:
            os.close(fd)
    app = _Pane()
    async with app.run_test(size=(200, 50)) as pilot:
        pane = app.query_one(ProcTree)
        pane.update_procs(ProcsEvent(t=100.0, run_tree=[], holders=found))
        await pilot.pause()
        text = pane.render().plain  # type: ignore[union-attr]
    stale_lines = [line for line in text.splitlines() if "STALE" in line]
    assert len(stale_lines) == 1 and f"STALE {compute.pid} " in stale_lines[0], text
    monitors = [line for line in text.splitlines() if "monitors (a device handle, no GPU context)" in line]
    assert len(monitors) == 1 and f"{monitor.pid} sleep" in monitors[0], text
    assert str(os.getpid()) not in text
