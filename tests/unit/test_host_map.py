"""The Proxmox host's NVML mapped into a container: host PID -> container (cgroup) -> PID inside it (NSpid).

For real: a PID namespace made with ``unshare --pid --fork --mount-proc`` stands in for the container, a child
cgroup named as Proxmox names a container's (``.../lxc/<CTID>/ns``) places it, recorded NVML answers (host PIDs)
stand in for the driver. The mapping must equal what the namespace's own /proc shows, and the container-side
merge, run inside that namespace, must make its holders exact.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.procfs import cgroup2_root, remove_cgroup_tree

from engine import protocol
from engine.agent import anomalies
from engine.host import holders, host_map, procs
from engine.host.gpus import NvmlGpus
from engine.protocol import GpuInfo, HostMap, HostProcess
from engine.supervisor import kill_stale
from tests.unit.test_holder_attribution import GIB, RecordedNvml

REPO = Path(__file__).resolve().parents[2]
CTID = "4242"
OTHER_CTID = "4243"


@pytest.mark.parametrize(
    ("cgroup", "ctid"),
    [
        ("0::/lxc/200/ns/system.slice/ssh.service\n", "200"),  # Proxmox, cgroup v2
        ("0::/lxc/200/ns/init.scope\n", "200"),
        ("12:pids:/lxc/200/ns\n11:memory:/lxc/200/ns\n0::/lxc/200/ns\n", "200"),  # hybrid
        ("5:devices:/lxc/105\n1:name=systemd:/lxc/105/init.scope\n", "105"),  # Proxmox, cgroup v1
        ("0::/lxc.payload.301/user.slice\n", "301"),  # plain LXC 4+
        ("0::/lxc.payload/301\n", "301"),
        ("0::/lxc.monitor/200\n", None),  # the container's monitor runs on the host
        ("0::/lxc.monitor.200\n", None),
        ("0::/system.slice/pvedaemon.service\n", None),
        ("0::/user.slice/user-0.slice/session-3.scope\n", None),
        ("0::/\n", None),
        ("0::/system.slice/lxcfs.service\n", None),
    ],
)
def test_container_id_from_the_cgroup_path(cgroup: str, ctid: str | None) -> None:
    assert host_map.container_of_cgroup(cgroup) == ctid


def test_nspid_of_a_host_process_has_one_field() -> None:
    assert host_map.read_nspid(os.getpid()) == [os.getpid()]


def _gpus() -> list[GpuInfo]:
    # The container numbers its GPUs in its own way: the host's GPU 1 (uuid GPU-recorded-1) is its only GPU, index 0.
    return [GpuInfo(index=0, name="H200", uuid="GPU-recorded-1", util_pct=100.0, mem_used_mib=20992.0, mem_total_mib=1)]


def _map(processes: list[HostProcess]) -> HostMap:
    return HostMap(t=time.time() + 1.0, ctid=CTID, hostname="pve", processes=processes)


def test_other_containers_and_the_host_are_shown_as_such_never_stale_never_killable(tmp_path: Path) -> None:
    other = HostProcess(9001, "GPU-recorded-1", 1, 8192.0, container=OTHER_CTID, ns_pid=77, cmd="python3 b.py")
    on_host = HostProcess(9002, "GPU-recorded-1", 1, 1024.0, container=None, ns_pid=None, cmd="Xorg")
    unseen_gpu = HostProcess(9003, "GPU-recorded-0", 0, 512.0, container=OTHER_CTID, ns_pid=5, cmd="python3 c.py")
    view = holders.NvmlView(host_map=_map([other, on_host, unseen_gpu]), gpus=_gpus())
    found = holders.find_holders(str(tmp_path), view)
    by_host_pid = {h.host_pid: h for h in found}
    assert set(by_host_pid) == {9001, 9002}  # the GPU this container does not see is not in its picture
    assert by_host_pid[9001].scope == "container" and by_host_pid[9001].container == OTHER_CTID
    assert by_host_pid[9002].scope == "host" and by_host_pid[9002].gpus == [0]
    assert all(not h.resolved and h.gpus_source == "host-nvml" for h in found)
    items = anomalies.gpu_anomalies(_gpus(), found, set(), run_active=False, host_view=True)
    assert [(a.kind, a.gpu) for a in items] == [("foreign_holder", 0)]
    assert f"container {OTHER_CTID} (host pid 9001" in items[0].message
    assert "the Proxmox host (host pid 9002" in items[0].message
    view = holders.NvmlView(host_map=_map([other, on_host]), gpus=_gpus())
    res = kill_stale.kill_stale(tmp_path / "root", dry_run=True, nvml=view)
    assert res["candidates"] == []
    reasons = {e["holder"].host_pid: e["reason"] for e in res["left_alone"]}
    assert "never signalled from this container" in reasons[9001] and "Proxmox host" in reasons[9002]


def test_phantom_is_stated_when_the_host_sees_no_process_anywhere(tmp_path: Path) -> None:
    busy_empty = GpuInfo(index=3, name="H200", uuid="u3", util_pct=100.0, mem_used_mib=0.0, mem_total_mib=1.0)
    busy_empty.holder_pids = [123456]  # the container's own NVML answer: a host PID, meaningless here
    found = holders.find_holders(str(tmp_path), holders.NvmlView(host_map=_map([]), gpus=[busy_empty]))
    (item,) = anomalies.gpu_anomalies([busy_empty], found, set(), run_active=False, host_view=True)
    assert item.kind == "phantom_utilization"
    assert "lists no process on it, in any container or on the host" in item.message


def test_a_mapped_pid_whose_start_time_differs_is_never_taken_for_the_holder(tmp_path: Path) -> None:
    me = procs.read_stat(os.getpid())
    assert me is not None
    reused = HostProcess(
        9100, "GPU-recorded-1", 1, 4096.0, container=CTID, ns_pid=os.getpid(), start_ticks=me.start_ticks + 7
    )
    (h,) = holders.find_holders(str(tmp_path), holders.NvmlView(host_map=_map([reused]), gpus=_gpus()))
    assert h.pid == os.getpid() and not h.resolved and h.host_pid == 9100


# -- for real: a PID namespace and an LXC-named cgroup ------------------------------------------------------------

INSIDE = r"""
import json, os, sys
dev, repo = sys.argv[1], sys.argv[2]
sys.path.insert(0, repo)
fds = [os.open(os.path.join(dev, n), os.O_RDONLY) for n in ("nvidia0", "nvidia1", "nvidiactl")]
with open("/proc/self/status") as fh:
    nspid = [int(x) for ln in fh if ln.startswith("NSpid:") for x in ln.split()[1:]]
print(json.dumps({"nspid": nspid, "proc": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}), flush=True)
line = sys.stdin.readline()  # the host's map, as the client hands it to the container's agent
from engine import protocol
from engine.host import holders, host_map, procs
from engine.protocol import GpuInfo
hm = host_map.host_map_from_json(json.loads(line))
gpus = [GpuInfo(index=0, name="H200", uuid="GPU-recorded-1", util_pct=97.0, mem_used_mib=29000.0, mem_total_mib=1.0)]
found = holders.find_holders(dev, holders.NvmlView(host_map=hm, gpus=gpus))
print(json.dumps(protocol.to_jsonable(found)), flush=True)
sys.stdin.readline()
"""


class Cgroups:
    """Child cgroups named as LXC names a container's, for processes this test started; removed afterwards."""

    def __init__(self) -> None:
        self.root: Path | None = None
        self.skip_reason: str | None = None
        base = cgroup2_root()
        if base is None:
            self.skip_reason = "no cgroup v2 hierarchy mounted"
            return
        top = base / f"specdec-test-{os.getpid()}"
        try:
            top.mkdir()
        except OSError as exc:
            self.skip_reason = f"cannot create a cgroup under {base}: {exc}"
            return
        self.root = top

    def place(self, pid: int, ctid: str) -> str:
        assert self.root is not None
        leaf = self.root / "lxc" / ctid / "ns"
        leaf.mkdir(parents=True, exist_ok=True)
        (leaf / "cgroup.procs").write_text(str(pid))
        return str(leaf)

    def remove(self) -> None:
        if self.root is not None:
            remove_cgroup_tree(self.root)


@pytest.fixture
def namespace(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A process in a fresh PID namespace holding stand-in GPU nodes; its own view of /proc; a cgroup if possible."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    if os.geteuid() != 0:
        pytest.skip("a PID namespace with --mount-proc needs root")
    dev = tmp_path / "dev"
    dev.mkdir()
    for n in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / n).write_bytes(b"")
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    outer = subprocess.Popen(
        [*unshare, sys.executable, "-c", INSIDE, str(dev), str(REPO)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert outer.stdout is not None and outer.stdin is not None
    line = outer.stdout.readline()
    if not line:
        err = outer.stderr.read().decode() if outer.stderr else ""
        outer.wait()
        pytest.skip(f"unshare --pid --fork --mount-proc does not work here: {err.strip()[-300:]}")
    view = json.loads(line)
    # unshare forks the namespace's first process: the only child of the unshare process, seen from here.
    stats = procs.all_stats()
    (host_pid,) = [pid for pid, st in stats.items() if st.ppid == outer.pid]
    # A second host process of this test placed in another container's cgroup (no PID namespace needed for that).
    neighbour = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    cg = Cgroups()
    placed: dict[int, str] = {}
    try:
        if cg.root is not None:
            placed[host_pid] = cg.place(host_pid, CTID)
            placed[neighbour.pid] = cg.place(neighbour.pid, OTHER_CTID)
        yield {
            "outer": outer,
            "host_pid": host_pid,
            "view": view,
            "neighbour": neighbour.pid,
            "cgroup_skip": cg.skip_reason,
            "dev": dev,
        }
    finally:
        neighbour.kill()
        neighbour.wait()
        outer.stdin.close()  # the namespace's process reads EOF and ends; unshare reaps it and exits
        try:
            outer.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            outer.kill()  # --kill-child: the namespace's process gets SIGKILL when unshare dies
            outer.wait()
        cg.remove()


def test_host_pid_maps_to_the_pid_the_namespace_itself_shows(namespace: dict[str, Any]) -> None:
    host_pid, view = namespace["host_pid"], namespace["view"]
    recorded = RecordedNvml([[(namespace["neighbour"], 2 * GIB)], [(host_pid, 28 * GIB)]])
    hm = host_map.build_host_map(NvmlGpus(recorded), CTID)
    by_pid = {p.host_pid: p for p in hm.processes}
    mine = by_pid[host_pid]
    assert mine.nspid == [host_pid, *view["nspid"]]  # NSpid seen from the host: host PID, then the namespace's
    assert mine.ns_pid == view["nspid"][-1] and mine.ns_pid in view["proc"]
    assert mine.ns_pid == 1  # unshare --fork: the namespace's first process
    assert mine.gpu_uuid == "GPU-recorded-1" and mine.host_gpu == 1 and mine.used_mib == 28 * 1024.0
    assert mine.start_ticks == procs.read_stat(host_pid).start_ticks  # type: ignore[union-attr]
    if namespace["cgroup_skip"]:
        pytest.skip(f"cgroup part: {namespace['cgroup_skip']}")
    assert mine.container == CTID and mine.cgroup is not None and f"/lxc/{CTID}/ns" in mine.cgroup
    neighbour = by_pid[namespace["neighbour"]]
    assert neighbour.container == OTHER_CTID and neighbour.ns_pid is None
    # Another tenant's command line never reaches this container (it may carry secrets): its program name only.
    assert neighbour.cmd and " " not in neighbour.cmd and "/" not in neighbour.cmd
    assert mine.cmd and " " in mine.cmd  # our own container's processes keep their full command line


def test_container_side_view_made_exact_inside_the_namespace(namespace: dict[str, Any]) -> None:
    if namespace["cgroup_skip"]:
        pytest.skip(f"needs the container's cgroup: {namespace['cgroup_skip']}")
    host_pid = namespace["host_pid"]
    recorded = RecordedNvml([[], [(host_pid, 28 * GIB), (namespace["neighbour"], 2 * GIB)]])
    hm = host_map.build_host_map(NvmlGpus(recorded), CTID)
    outer = namespace["outer"]
    outer.stdin.write((json.dumps(protocol.to_jsonable(hm)) + "\n").encode())
    outer.stdin.flush()
    line = outer.stdout.readline()
    assert line, outer.stderr.read().decode()[-2000:]
    found = json.loads(line)
    ours = [h for h in found if h["scope"] == "here"]
    assert [(h["pid"], h["resolved"], h["gpus"], h["gpus_source"], h["host_pid"]) for h in ours] == [
        (1, True, [0], "host-nvml", host_pid)  # pid 1 in there holds the container's GPU 0 (host GPU 1), exactly
    ]
    assert ours[0]["per_gpu"] == [{"gpu": 0, "used_mib": 28 * 1024.0}] and ours[0]["container"] == CTID
    (other,) = [h for h in found if h["scope"] != "here"]
    assert (other["scope"], other["container"], other["host_pid"], other["resolved"]) == (
        "container",
        OTHER_CTID,
        namespace["neighbour"],
        False,
    )
