"""The process pane says where holders' GPUs come from: exact (NVML, the Proxmox host) or the fd scan's guess,
and lists other containers' and the host's holders apart from ours."""

from __future__ import annotations

from typing import Any

from textual.app import App, ComposeResult

from engine.protocol import ProcsEvent, from_json
from tui.dashboard.widgets.proc_tree import ProcTree, ThreadHealthModel


class _Pane(App[None]):
    def compose(self) -> ComposeResult:
        yield ProcTree(ThreadHealthModel(), clock=lambda: 0.0, id="procs")


def _holder(pid: int, **kw: Any) -> dict[str, Any]:
    return {"pid": pid, "resolved": True, "user": "ml", "cmd": "python3 train.py", "used_mib": 20480.0, **kw}


async def _rendered(event: dict[str, Any]) -> str:
    app = _Pane()
    async with app.run_test() as pilot:
        pane = app.query_one(ProcTree)
        pane.update_procs(from_json(ProcsEvent, {"t": 0.0, **event}))  # the procs event as the session decodes it
        await pilot.pause()
        return pane.render().plain  # type: ignore[union-attr]


async def test_fd_scan_gpus_are_shown_as_a_guess_with_the_reason() -> None:
    text = await _rendered(
        {
            "holders": [_holder(41, gpus=[0, 1], gpus_source="fd-scan")],
            "holders_source": {"source": "fd-scan", "detail": "NVML's PIDs do not resolve in this PID namespace"},
        }
    )
    assert "gpu ? (fd scan: 0,1)" in text and "GPUs from the fd scan, not exact" in text


async def test_host_mapped_holders_are_exact_and_other_containers_listed_apart() -> None:
    text = await _rendered(
        {
            "holders": [
                _holder(41, gpus=[1], gpus_source="host-nvml"),
                _holder(9001, resolved=False, gpus=[0], gpus_source="host-nvml", scope="container", container="201",
                        host_pid=9001, cmd="python3 other.py"),
            ],
            "holders_source": {"source": "host-nvml", "detail": "NVML on the Proxmox host pve, mapped into 200"},
            "host_map": {"state": "ok", "detail": "NVML on the Proxmox host pve, mapped into 200"},
        }
    )  # fmt: skip
    stale, _, foreign = text.partition("other containers and the host")
    assert "41" in stale and "gpu 1 " in stale and "other.py" not in stale
    assert "ct 201" in foreign and "host pid 9001" in foreign and "other.py" in foreign
    assert "exact, from the Proxmox host" in text


async def test_an_unreachable_host_is_said_in_the_pane() -> None:
    text = await _rendered(
        {"holders": [], "host_map": {"state": "unavailable", "detail": "the Proxmox host cannot list GPU processes"}}
    )
    assert "host view unavailable: the Proxmox host cannot list GPU processes" in text
