"""On a GPU host: the real agent against real NVML, checked against nvidia-smi at the same moment.

Run on the lent H200 (`device` tool) from the repo root:  python3 tests/device/agent_nvml.py [--skip-engine]
Prints a report; exits non-zero when a check fails. Steps:
1. NVML sample cost (the agent's GpuSource.sample) over 2000 samples: median and p99.
2. A CUDA process (torch) allocates ~8 GiB and keeps the GPU busy; the agent's `status` (a real agent
   subprocess speaking JSON lines) must list it as a resolved holder with memory, and the GPU's memory
   and utilization must agree with `nvidia-smi --query-gpu` taken right after.
3. Which /dev/nvidia* nodes a CUDA process and an NVML-only process (nvidia-smi) hold, to tell
   compute holders from monitors.
4. The agent launches the engine on CUDA (tiny target, compiled flex attention, 2 drafter threads) under
   the supervisor, waits for `first-step`, checks the engine is a holder inside the run (not stale), then
   `stop`s it: SIGTERM, checkpoint, exit 0, GPU released.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from support.agent import AgentClient, Event  # noqa: E402

from engine.host import procs  # noqa: E402
from engine.host.gpu_source import open_gpu_source  # noqa: E402

failures: list[str] = []
# AGENT_NVML_DEVICE=cpu runs only the engine part on the CPU (a dry run of this script off the GPU host).
DEVICE = os.environ.get("AGENT_NVML_DEVICE", "cuda:0")


def check(ok: bool, what: str) -> None:
    print(("PASS " if ok else "FAIL ") + what, flush=True)
    if not ok:
        failures.append(what)


def nvidia_smi() -> list[dict[str, str]]:
    fields = "index,uuid,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [
        dict(zip(fields.split(","), (v.strip() for v in line.split(",")), strict=True)) for line in out.splitlines()
    ]


def main() -> int:
    source = open_gpu_source(0)
    print(f"gpu source: {source.source} error={source.error}")
    check(source.source == "nvml", "NVML source available")
    if source.source != "nvml":
        return 1

    times_us = []
    for _ in range(2000):
        t0 = time.perf_counter()
        source.sample()
        times_us.append((time.perf_counter() - t0) * 1e6)
    times_us.sort()
    n = len(source.sample().gpus)
    print(
        f"NVML sample, {n} GPU(s), all fields + processes: median {statistics.median(times_us):.0f} us, "
        f"p99 {times_us[int(0.99 * len(times_us))]:.0f} us"
    )

    # A CUDA holder that allocates 8 GiB and keeps the GPU busy until told to stop.
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import torch,sys,time\n"
                "x=torch.empty(8*1024**3,dtype=torch.uint8,device='cuda')\n"
                "a=torch.randn(8192,8192,device='cuda',dtype=torch.bfloat16)\n"
                "print('ready',flush=True)\n"
                "t=time.time()\n"
                "while time.time()-t<60:\n"
                "    a@a\n"
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert worker.stdout is not None
    check(worker.stdout.readline().strip() == "ready", "CUDA worker allocated 8 GiB")
    time.sleep(2.0)  # let NVML's utilization window see the busy GPU

    with tempfile.TemporaryDirectory() as run_root:
        agent = AgentClient(run_root)
        print("hello capabilities:", json.dumps(agent.hello["capabilities"]))
        check(agent.hello["capabilities"]["nvml"]["ok"], "agent hello says NVML ok")
        t0 = time.perf_counter()
        status = agent.ok("status")
        status_ms = (time.perf_counter() - t0) * 1e3
        smi = nvidia_smi()
        agent.close()
    print(f"status round trip {status_ms:.1f} ms")
    gpus = status["gpus"]
    check(len(gpus) == len(smi), f"agent sees {len(gpus)} GPU(s), nvidia-smi {len(smi)}")
    for g, s in zip(gpus, smi, strict=False):
        print(
            f"GPU {g['index']}: agent util={g['util_pct']} mem={g['mem_used_mib']:.0f}/{g['mem_total_mib']:.0f} MiB "
            f"temp={g['temp_c']} power={g['power_w']} | nvidia-smi util={s['utilization.gpu']} "
            f"mem={s['memory.used']}/{s['memory.total']} temp={s['temperature.gpu']} power={s['power.draw']}"
        )
        check(g["uuid"] == s["uuid"], f"GPU {g['index']} uuid matches nvidia-smi")
        check(
            abs(g["mem_used_mib"] - float(s["memory.used"])) < 64,
            f"GPU {g['index']} memory within 64 MiB of nvidia-smi",
        )
        check(abs(g["mem_total_mib"] - float(s["memory.total"])) < 2, f"GPU {g['index']} total memory matches")
        check(
            g["util_pct"] is not None and g["util_pct"] >= 50,
            f"GPU {g['index']} busy under the worker (util {g['util_pct']})",
        )
    holders = status["processes"]["holders"]
    print("holders:", json.dumps(holders))
    mine = [h for h in holders if h["pid"] == worker.pid]
    check(bool(mine) and mine[0]["resolved"], "the CUDA worker is a resolved holder")
    check(bool(mine) and (mine[0].get("used_mib") or 0) >= 8000, "holder memory from NVML >= 8000 MiB")
    me = [h for h in holders if h["pid"] == os.getpid()]
    check(bool(me) and me[0].get("context") is False, "this script (NVML only, no CUDA context) has context=False")
    stale = [a for a in status["anomalies"] if a["kind"] == "stale_holder"]
    check({a["pid"] for a in stale} == {worker.pid}, f"only the CUDA worker is a stale holder ({stale})")
    nodes = procs.scan_device_holders(None, [worker.pid]).get(worker.pid, set())
    print("CUDA worker holds:", sorted(nodes))
    smi_proc = subprocess.Popen(["nvidia-smi", "-l", "1"], stdout=subprocess.DEVNULL)
    time.sleep(1.5)
    smi_nodes = procs.scan_device_holders(None, [smi_proc.pid]).get(smi_proc.pid, set())
    print("nvidia-smi -l holds:", sorted(smi_nodes))
    smi_proc.terminate()
    smi_proc.wait()
    worker.terminate()
    worker.wait()
    if "--skip-engine" not in sys.argv:
        engine_on_cuda()
    print(f"{len(failures)} failure(s)")
    return 1 if failures else 0


def print_progress(ev: Event) -> None:
    if ev["ev"] in ("milestone", "progress"):
        print("  event:", json.dumps(ev), flush=True)


def engine_on_cuda() -> None:
    with tempfile.TemporaryDirectory() as run_root:
        agent = AgentClient(run_root, on_event=print_progress)
        out_dir = Path(run_root) / "engine-out"
        command = [
            sys.executable,
            "-m",
            "engine.trainer",
            "--preset",
            "cpu-demo",
            "--set",
            f'target_devices=["{DEVICE}"]',
            "--set",
            f'drafter_devices=["{DEVICE}","{DEVICE}"]',
            "--set",
            "compile=" + ("false" if DEVICE == "cpu" else "true"),
            "--set",
            'attention="' + ("sdpa" if DEVICE == "cpu" else "flex") + '"',
            "--set",
            "step_delay_s=0.0",
            "--set",
            "checkpoint_every=100000",
            "--output-dir",
            str(out_dir),
        ]
        t0 = time.time()
        rep = agent.request("launch", command=command, cwd=str(REPO), env={"PYTHONPATH": str(REPO)})
        check(rep["ok"], f"launch accepted: {rep.get('error') or rep['result'].get('run_id')}")
        rep = agent.request("wait", reply_within_s=300, milestone="first-step", timeout_s=240)
        res = rep["result"] or {}
        print("wait:", json.dumps({k: res.get(k) for k in ("ok", "stage", "cause", "elapsed_s")}))
        check(bool(res.get("ok")), f"engine on CUDA reached first-step in {time.time() - t0:.1f} s")
        if not res.get("ok"):
            print("\n".join(res.get("last_lines") or []))
        st = agent.request("status")["result"]
        run = st["run"] or {}
        tree = {p["pid"] for p in st["processes"]["run_tree"]}
        threads = sorted({t["name"] for p in st["processes"]["run_tree"] for t in p.get("threads", [])})
        print("run:", run.get("state"), "stage:", run.get("stage"), "threads:", threads)
        holders = st["processes"]["holders"]
        print("holders:", json.dumps(holders))
        engine_holders = [h for h in holders if h["pid"] in tree]
        check(bool(engine_holders) and all(h["in_run"] for h in engine_holders), "engine process holds the GPU, in_run")
        stale = [a for a in st["anomalies"] if a["kind"] == "stale_holder"]
        check(not stale, f"no stale-holder anomaly for the run's own process ({stale})")
        rep = agent.request("stop", reply_within_s=120, grace_s=60, release_timeout_s=30)
        print("stop:", json.dumps(rep.get("result") or rep.get("error")))
        st = agent.request("status")["result"]
        run = st["run"] or {}
        print("after stop:", run.get("state"), "exit", run.get("exit_code"), "signal", run.get("signal"))
        check(run.get("state") == "stopped" and run.get("exit_code") == 0, "SIGTERM stop -> exit 0, stopped")
        ckpts = sorted(p.name for p in out_dir.rglob("*") if "ckpt" in p.name or "checkpoint" in str(p.parent))
        print("checkpoints:", ckpts[:6])
        check(bool(ckpts), "a checkpoint was saved on SIGTERM")
        tail = agent.request("tail", n=8)["result"]["lines"]
        print("last lines:\n  " + "\n  ".join(tail))
        agent.close()


if __name__ == "__main__":
    if DEVICE == "cpu":
        engine_on_cuda()
        sys.exit(1 if failures else 0)
    sys.exit(main())
