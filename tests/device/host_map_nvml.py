"""On a GPU host (root): the Proxmox host-side mapping against real NVML, a PID namespace standing in for the container.

Run from the repo root:  python3 tests/device/host_map_nvml.py [--ctid 4242] [--gib 4]
(``--dry-run-cpu``: off the GPU host, the process allocates on the CPU and recorded NVML answers name it.)
Prints a report; exits non-zero when a check fails. Steps:
1. A process in a fresh PID namespace (`unshare --pid --fork --kill-child --mount-proc`) allocates GIB GiB on
   cuda:0 with torch and keeps the GPU busy; it prints its own view (NSpid, /proc) first. When a cgroup v2
   hierarchy is writable it is placed in a child cgroup named as Proxmox names a container's (.../lxc/CTID/ns).
2. The host-side mapping (engine/host/host_map.py build_host_map, the agent's `host_map` command) runs
   against real NVML: host pid, container, pid in the namespace, GPU, MiB, each printed; compared with
   the namespace's own view and with `nvidia-smi --query-compute-apps`. Its cost is timed.
3. What NVML says from inside the namespace (does the driver give host PIDs there?), and the container-side
   merge (holders.find_holders with the host map) run inside the namespace: the holder must be pid 1 there,
   resolved, on GPU 0 only, gpus_source host-nvml, with the memory the host saw.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.procfs import cgroup2_root, remove_cgroup_tree  # noqa: E402
from support.waiting import wait_until  # noqa: E402

from engine import protocol  # noqa: E402
from engine.host import host_map, procs  # noqa: E402
from engine.host.gpu_source import open_gpu_source  # noqa: E402

failures: list[str] = []

INSIDE = r"""
import json, os, sys, threading
repo, gib, dev = sys.argv[1], float(sys.argv[2]), sys.argv[3]
sys.path.insert(0, repo)
import torch
x = torch.ones(int(gib * (1 << 30)) // 4, device=dev)  # float32: 4 bytes each
a = torch.randn(4096 if dev != "cpu" else 64, 4096 if dev != "cpu" else 64, device=dev)
stop = threading.Event()
def spin():
    while not stop.is_set():
        for _ in range(50):
            a @ a
        if dev != "cpu":
            torch.cuda.synchronize()
        else:
            stop.wait(0.01)
threading.Thread(target=spin, daemon=True).start()
with open("/proc/self/status") as fh:
    nspid = [int(v) for ln in fh if ln.startswith("NSpid:") for v in ln.split()[1:]]
print(json.dumps({"nspid": nspid, "proc": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}), flush=True)
line = sys.stdin.readline()
if not line:
    sys.exit(0)
from engine import protocol
from engine.host import holders, host_map, procs
from engine.host.gpu_source import open_gpu_source
hm = host_map.host_map_from_json(json.loads(line))
src = open_gpu_source(0)
sample = src.sample()
if dev == "cpu":  # dry run: no GPU here; the host's (recorded) GPUs stand in for ours
    from engine.protocol import GpuInfo
    sample.gpus = [GpuInfo(index=g.index, name="dry", uuid=g.uuid, util_pct=g.util_pct, mem_used_mib=g.mem_used_mib,
                           mem_total_mib=None) for g in hm.gpus]
inside_nvml = {str(pid): gpus for pid, gpus in sample.pid_gpus.items()}
plain = holders.find_holders(None, holders.NvmlView.of_sample(sample, "nvml", None))
exact = holders.find_holders(None, holders.NvmlView(host_map=hm, gpus=sample.gpus))
print(json.dumps({"inside_nvml_pids": inside_nvml, "without_host_map": protocol.to_jsonable(plain),
                  "with_host_map": protocol.to_jsonable(exact)}), flush=True)
sys.stdin.readline()
stop.set()
"""


def check(ok: bool, what: str) -> None:
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def compute_apps() -> dict[int, dict[str, str]]:
    """nvidia-smi's own per-process list: pid -> {gpu_uuid, used_memory (MiB)}."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    apps: dict[int, dict[str, str]] = {}
    for line in out.splitlines():
        parts = [v.strip() for v in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            apps[int(parts[0])] = {"gpu_uuid": parts[1], "used_memory": parts[2]}
    return apps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctid", default="4242")
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--dry-run-cpu", action="store_true", help="no GPU: CPU tensors, recorded NVML answers")
    ns = ap.parse_args()
    if shutil.which("unshare") is None or os.geteuid() != 0:
        print("needs unshare (util-linux) and root", flush=True)
        return 2
    source: Any = open_gpu_source(0)
    print(f"gpu source: {source.source} error={source.error}", flush=True)
    if source.error is not None and not ns.dry_run_cpu:
        return 2
    unshare = ["unshare", "--pid", "--fork", "--kill-child", "--mount-proc"]
    outer = subprocess.Popen(
        [*unshare, sys.executable, "-c", INSIDE, str(REPO), str(ns.gib), "cpu" if ns.dry_run_cpu else "cuda:0"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert outer.stdin is not None and outer.stdout is not None
    cg_top: Path | None = None
    try:
        t0 = time.monotonic()
        line = outer.stdout.readline()
        if not line:
            check(False, f"the namespace's process started (exit {outer.wait()})")
            return 1
        view = json.loads(line)
        print(f"namespace's own view: NSpid {view['nspid']}, /proc pids {view['proc']} ({time.monotonic() - t0:.1f} s)")
        (host_pid,) = [pid for pid, st in procs.all_stats().items() if st.ppid == outer.pid]
        print(f"host pid of the namespace's process: {host_pid}")
        base = cgroup2_root()
        if base is not None:
            try:
                leaf = base / f"specdec-test-{os.getpid()}" / "lxc" / ns.ctid / "ns"
                leaf.mkdir(parents=True)
                (leaf / "cgroup.procs").write_text(str(host_pid))
                cg_top = leaf.parents[2]
                print(f"placed in cgroup {leaf}")
            except OSError as exc:
                print(f"cgroup part skipped: cannot create a cgroup under {base}: {exc}")
        else:
            print("cgroup part skipped: no cgroup v2 hierarchy mounted")
        if ns.dry_run_cpu:
            sys.path.insert(0, str(REPO / "tests" / "unit"))
            from test_holder_attribution import RecordedNvml

            from engine.host.gpus import NvmlGpus

            source = NvmlGpus(RecordedNvml([[(host_pid, int(ns.gib * (1 << 30)))], []]))
        try:
            wait_until(lambda: host_pid in source.sample().pid_gpus, 60, "NVML to list it", interval_s=0.2)
        except AssertionError as exc:
            print(f"note: {exc}", flush=True)  # the checks below say what is missing
        hm = host_map.build_host_map(source, ns.ctid)
        costs_ms = []
        for _ in range(50):
            t = time.perf_counter()
            host_map.build_host_map(source, ns.ctid)
            costs_ms.append((time.perf_counter() - t) * 1000)
        print(f"build_host_map cost: median {statistics.median(costs_ms):.2f} ms, max {max(costs_ms):.2f} ms "
              f"({len(hm.processes)} NVML processes)")  # fmt: skip
        apps = (
            compute_apps()
            if not ns.dry_run_cpu
            else {p.host_pid: {"gpu_uuid": p.gpu_uuid, "used_memory": str(p.used_mib)} for p in hm.processes}
        )
        print("host pid | ns pid | container | host GPU | MiB (NVML) | MiB (nvidia-smi) | cgroup | cmd")
        for p in hm.processes:
            smi = apps.get(p.host_pid, {}).get("used_memory", "-")
            print(f"{p.host_pid} | {p.ns_pid} | {p.container} | {p.host_gpu} {p.gpu_uuid[:12]} | "
                  f"{p.used_mib} | {smi} | {p.cgroup} | {' '.join((p.cmd or '').split())[:60]}")  # fmt: skip
        mine = [p for p in hm.processes if p.host_pid == host_pid]
        check(len(mine) == 1, f"NVML on the host lists the namespace's process (host pid {host_pid}) once")
        if mine:
            m = mine[0]
            check(m.ns_pid == view["nspid"][-1], f"ns pid {m.ns_pid} == the namespace's own NSpid {view['nspid']}")
            check(m.ns_pid in view["proc"], "that pid is in the namespace's own /proc")
            check(m.host_gpu == 0, f"on GPU 0 only (got host GPU {m.host_gpu})")
            app = apps.get(host_pid)
            check(app is not None and app["gpu_uuid"] == m.gpu_uuid, "nvidia-smi names the same GPU uuid")
            if app is not None and m.used_mib is not None:
                check(abs(float(app["used_memory"]) - m.used_mib) <= 2.0, f"MiB equal to nvidia-smi's ({app})")
            check(m.used_mib is not None and m.used_mib >= ns.gib * 1024 - 1.0, f"at least {ns.gib} GiB charged")
            if cg_top is not None:
                check(m.container == ns.ctid, f"container {m.container} from the cgroup {m.cgroup}")
        outer.stdin.write((json.dumps(protocol.to_jsonable(hm)) + "\n").encode())
        outer.stdin.flush()
        inside_line = outer.stdout.readline()
        check(bool(inside_line), "the namespace's process answered with its own views")
        if inside_line:
            inside: dict[str, Any] = json.loads(inside_line)
            print(f"NVML inside the namespace lists pids {inside['inside_nvml_pids']} (host pid {host_pid})")
            for h in inside["without_host_map"]:
                print(f"  without host map: pid {h['pid']} resolved={h['resolved']} gpus={h['gpus']} "
                      f"source={h['gpus_source']} MiB={h['used_mib']}")  # fmt: skip
            for h in inside["with_host_map"]:
                print(f"  with host map:    pid {h['pid']} resolved={h['resolved']} gpus={h['gpus']} "
                      f"source={h['gpus_source']} MiB={h['used_mib']} scope={h['scope']} "
                      f"host_pid={h['host_pid']}")  # fmt: skip
            if cg_top is not None:
                ours = [h for h in inside["with_host_map"] if h["scope"] == "here" and h["host_pid"] == host_pid]
                check(
                    len(ours) == 1 and ours[0]["pid"] == view["nspid"][-1] and ours[0]["resolved"]
                    and ours[0]["gpus"] == [0] and ours[0]["gpus_source"] == "host-nvml",
                    "inside the namespace the holder is exact: its own pid, GPU 0 only, from the host",
                )  # fmt: skip
    finally:
        if outer.stdin is not None and not outer.stdin.closed:
            outer.stdin.close()
        try:
            outer.wait(timeout=30)
        except subprocess.TimeoutExpired:
            outer.kill()
            outer.wait()
        if cg_top is not None:
            try:
                remove_cgroup_tree(cg_top)
            except AssertionError as exc:
                print(f"note: {exc}", flush=True)
    print("FAILURES: " + "; ".join(failures) if failures else "ALL PASS", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
