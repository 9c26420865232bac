"""kill_stale through the real agent, with stand-in GPU holders and decoys.

Stand-in holders are processes holding open files named nvidia0/nvidia1 under a temporary
SPECDEC_DEV_DIR, which the agent scans instead of /dev. Decoys: plain sleepers that hold no
device, and a child of the current run that does hold one. Only the stale holders may be listed
and signalled.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.agent import AgentClient, AgentPool, launch_and_wait
from support.procfs import pid_alive
from support.waiting import wait_until

from engine.host import procs
from engine.supervisor import records

pytestmark = pytest.mark.tmux

HOLD = "import signal, sys, time\n{ignore}f = open(sys.argv[1])\nprint('holding', flush=True)\ntime.sleep(600)\n"


def holds(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


class Scene:
    def __init__(self, dev: Path, agent: AgentClient, run_dir: Path, run_holder: int, procs_: dict[str, int]) -> None:
        self.dev = dev
        self.agent = agent
        self.run_dir = run_dir
        self.run_holder = run_holder
        self.pids = procs_

    def identity(self, name: str) -> list[float]:
        ident = procs.proc_identity(self.pids[name])
        assert ident is not None
        return [ident[0], ident[1]]


@pytest.fixture
def scene(tmp_path: Path, pool: AgentPool) -> Iterator[Scene]:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl"):
        (dev / name).write_text("")
    started: list[subprocess.Popen[bytes]] = []

    def spawn(code: str, *args: str) -> int:
        p = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        started.append(p)
        return p.pid

    pids = {
        "stale": spawn(HOLD.format(ignore=""), str(dev / "nvidia0")),
        "stale_stubborn": spawn(
            HOLD.format(ignore="signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"), str(dev / "nvidiactl")
        ),
        "decoy": spawn("import time; time.sleep(600)"),
    }
    agent = pool.make(env={"SPECDEC_DEV_DIR": str(dev)})
    hold_run = HOLD.format(ignore="").replace("\n", "; ")
    run_cmd = ["bash", "-c", f'{sys.executable} -c "$0" "$1" & wait', hold_run, str(dev / "nvidia1")]
    launched, res, _ = launch_and_wait(agent, run_cmd, "started", 20)
    assert res["ok"], res
    run_dir = Path(launched["run_dir"])

    def run_holder() -> int | None:
        launch = records.read_json(run_dir / records.LAUNCH_JSON) or {}
        for pid in procs.tree_pids(launch.get("job_pid") or 0):
            if holds(pid, dev / "nvidia1"):
                return pid
        return None

    holder_in_run = wait_until(run_holder, 10, "the run's child to open nvidia1")
    wait_until(lambda: holds(pids["stale"], dev / "nvidia0"), 10, "the stale holder to open nvidia0")
    wait_until(lambda: holds(pids["stale_stubborn"], dev / "nvidiactl"), 10, "the stubborn holder to open nvidiactl")
    yield Scene(dev, agent, run_dir, holder_in_run, pids)
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def test_dry_run_lists_only_the_stale_holders(scene: Scene) -> None:
    res = scene.agent.ok("kill_stale", dry_run=True)
    listed = {c["pid"] for c in res["candidates"]}
    assert listed == {scene.pids["stale"], scene.pids["stale_stubborn"]}
    by_pid = {c["pid"]: c for c in res["candidates"]}
    stale = by_pid[scene.pids["stale"]]
    assert stale["gpus"] == [0] and stale["user"] == "root" and stale["create_time"] is not None
    assert stale["state"] == "sleeping" and stale["age_s"] >= 0 and str(scene.dev / "nvidia0") in stale["cmd"]
    assert by_pid[scene.pids["stale_stubborn"]]["gpus"] == []  # nvidiactl names no GPU
    left = {e["holder"]["pid"]: e["reason"] for e in res["left_alone"]}
    assert left[scene.run_holder] == "part of the current run"
    assert res["signalled"] == [] and res["failed"] == []
    assert all(pid_alive(p) for p in scene.pids.values()) and pid_alive(scene.run_holder)


def test_yes_signals_exactly_the_listed_holders_and_escalates_for_the_stubborn_one(scene: Scene) -> None:
    listed = scene.agent.ok("kill_stale", dry_run=True)["candidates"]
    targets = [[c["pid"], c["create_time"]] for c in listed]
    res = scene.agent.ok("kill_stale", dry_run=False, targets=targets, grace_s=1.0)
    outcome = {e["pid"]: e for e in res["signalled"]}
    assert set(outcome) == {scene.pids["stale"], scene.pids["stale_stubborn"]}
    assert outcome[scene.pids["stale"]]["signals"] == ["SIGTERM"]
    assert outcome[scene.pids["stale"]]["outcome"].startswith("exited")
    assert outcome[scene.pids["stale_stubborn"]]["signals"] == ["SIGTERM", "SIGKILL"]
    assert outcome[scene.pids["stale_stubborn"]]["outcome"] == "killed by SIGKILL after the grace"
    assert res["failed"] == []
    assert not pid_alive(scene.pids["stale"]) and not pid_alive(scene.pids["stale_stubborn"])
    assert pid_alive(scene.pids["decoy"]), "a process holding no device was touched"
    assert pid_alive(scene.run_holder), "a process of the current run was touched"
    assert records.read_run(scene.run_dir, procs.read_boot_id()).state == "running"


def test_targets_that_are_not_stale_holders_are_refused_with_the_reason(scene: Scene) -> None:
    stale_pid, stale_ct = scene.identity("stale")
    run_ident = procs.proc_identity(scene.run_holder)
    assert run_ident is not None
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    stubborn_pid, stubborn_ct = scene.identity("stale_stubborn")
    targets = [
        [stale_pid, stale_ct - 5.0],  # the PID as if it had been reused by another process
        [stubborn_pid, stubborn_ct - tick],  # listed one clock tick before this process started: another one
        scene.identity("decoy"),
        [run_ident[0], run_ident[1]],
    ]
    res = scene.agent.ok("kill_stale", dry_run=False, targets=targets, grace_s=1.0)
    assert res["signalled"] == []
    reasons = {f["pid"]: f["reason"] for f in res["failed"]}
    assert "PID now belongs to another process" in reasons[stale_pid]
    assert "PID now belongs to another process" in reasons[stubborn_pid]
    assert reasons[scene.pids["decoy"]] == "holds no NVIDIA device: never touched by kill-stale"
    assert reasons[scene.run_holder] == "not a stale holder: part of the current run"
    assert all(pid_alive(p) for p in scene.pids.values()) and pid_alive(scene.run_holder)


def test_yes_without_targets_signals_every_listed_holder_and_nothing_else(scene: Scene) -> None:
    res = scene.agent.ok("kill_stale", dry_run=False, targets=None, grace_s=1.0)
    assert {e["pid"] for e in res["signalled"]} == {scene.pids["stale"], scene.pids["stale_stubborn"]}
    progress = [e["message"] for e in scene.agent.events if e.get("ev") == "progress"]
    assert any(m.startswith(f"SIGTERM to pid {scene.pids['stale']}") for m in progress), progress
    assert pid_alive(scene.pids["decoy"]) and pid_alive(scene.run_holder)


def test_malformed_targets_are_refused_before_anything_is_signalled(pool: AgentPool) -> None:
    a = pool.make()
    reply = a.request("kill_stale", dry_run=False, targets=[[os.getpid(), None]])
    assert reply["ok"] is False and "number pairs" in reply["error"]
    assert pid_alive(os.getpid())
    bad_mode = a.request("kill_stale", dry_run="yes")
    assert bad_mode["ok"] is False and bad_mode["error"] == "dry_run must be true or false"


def test_holders_from_the_simulated_gpu_source_are_listed_with_memory_and_signalled(
    pool: AgentPool, tmp_path: Path
) -> None:
    dev = tmp_path / "empty-dev"
    dev.mkdir()
    a = pool.make(env={"SPECDEC_DEV_DIR": str(dev)}, args=["--simulate-gpus", "2"])
    stale = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        a.ok("sim", gpu=1, mem_used_mib=20000, holder_pid=stale.pid)
        listed = a.ok("kill_stale", dry_run=True)["candidates"]
        assert [(c["pid"], c["gpus"], c["used_mib"], c["source"]) for c in listed] == [
            (stale.pid, [1], 20000, "simulated")
        ]
        res = a.ok("kill_stale", dry_run=False, targets=[[c["pid"], c["create_time"]] for c in listed], grace_s=2)
        assert [e["pid"] for e in res["signalled"]] == [stale.pid]
        assert stale.wait(timeout=10) == -15
        assert decoy.poll() is None
    finally:
        for p in (stale, decoy):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv")
def test_another_users_holder_is_left_alone_even_by_a_root_agent(pool: AgentPool) -> None:
    # The agent runs as root (it could signal anyone); the holder belongs to nobody: a colleague's GPU job on a
    # shared box. kill-stale lists it as left alone, with the owner, and refuses it even when named as a target.
    dev = Path(tempfile.mkdtemp(prefix="specdec-dev-"))
    try:
        dev.chmod(0o755)
        (dev / "nvidia0").write_text("")
        (dev / "nvidia0").chmod(0o644)
        holder = subprocess.Popen(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                "sh",
                "-c",
                f"exec sleep 600 3<{dev}/nvidia0",
            ]
        )
        try:
            wait_until(lambda: holds(holder.pid, dev / "nvidia0"), 10, "the other user's holder to open nvidia0")
            a = pool.make(env={"SPECDEC_DEV_DIR": str(dev)})
            listed = a.ok("kill_stale", dry_run=True)
            assert listed["candidates"] == []
            left = {e["holder"]["pid"]: e for e in listed["left_alone"]}
            assert holder.pid in left, listed
            reason = left[holder.pid]["reason"]
            owner = pwd.getpwuid(65534).pw_name
            assert reason == f"owned by user {owner}; kill-stale only signals your own processes", reason
            ct = left[holder.pid]["holder"]["create_time"]
            res = a.ok("kill_stale", dry_run=False, targets=[[holder.pid, ct]], grace_s=1)
            assert res["signalled"] == []
            assert [f["pid"] for f in res["failed"]] == [holder.pid]
            assert res["failed"][0]["reason"] == f"not a stale holder: {reason}"
            every = a.ok("kill_stale", dry_run=False, grace_s=1)  # no targets: every candidate, none of theirs
            assert every["signalled"] == []
            assert holder.poll() is None
        finally:
            holder.kill()
            holder.wait(timeout=10)
    finally:
        shutil.rmtree(dev)


def test_a_stale_job_cannot_hide_by_its_name_and_an_agent_is_known_by_its_record(
    pool: AgentPool, tmp_path: Path
) -> None:
    # Two stale jobs calling themselves nvidia-smi and specdec-agent (argv[0]): both are still stale holders (the one
    # named specdec-agent has a CUDA context: /dev/nvidia-uvm open). A holder recorded as a live agent in the run
    # root's agents/ (as every agent records itself) is left alone, unless it has /dev/nvidia-uvm open too: a CUDA
    # context, GPU memory, whatever it is. An agent of another run root (not recorded here), with no GPU context,
    # is known by its command line: killing it would free no GPU memory.
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm"):
        (dev / name).write_text("")
    hold = HOLD.format(ignore="") + "\n"
    started: list[subprocess.Popen[bytes]] = []

    def spawn(argv0: str, *devices: str) -> int:
        opens = "".join(f"g{i} = open(sys.argv[{i + 2}])\n" for i in range(len(devices) - 1))
        code = hold.replace("f = open(sys.argv[1])\n", "f = open(sys.argv[1])\n" + opens)
        argv = ["bash", "-c", 'exec -a "$0" "$@"', argv0, sys.executable, "-c", code, *(str(dev / d) for d in devices)]
        p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        started.append(p)
        wait_until(lambda: all(holds(p.pid, dev / d) for d in devices), 10, f"{argv0} to open {devices}")
        return p.pid

    try:
        as_smi = spawn("nvidia-smi", "nvidia0")
        as_agent = spawn("specdec-agent", "nvidia0", "nvidia-uvm")
        other_roots_agent = spawn("specdec-agent", "nvidiactl")
        recorded = spawn("python3", "nvidiactl")
        recorded_with_context = spawn("python3", "nvidia0", "nvidia-uvm")
        a = pool.make(env={"SPECDEC_DEV_DIR": str(dev)})
        listed = a.ok("kill_stale", dry_run=True)
        assert {as_smi, as_agent} <= {c["pid"] for c in listed["candidates"]}, listed  # their names hide nothing
        left = {e["holder"]["pid"]: e["reason"] for e in listed["left_alone"]}
        assert left[other_roots_agent].startswith("a specdec agent by its command line"), left

        agents = pool.root / "agents"
        own = f"{a.proc.pid}-{procs.start_ticks_of(a.proc.pid)}"
        assert [e.name for e in agents.iterdir()] == [own]  # the agent recorded itself at its start
        for pid in (recorded, recorded_with_context):
            (agents / f"{pid}-{procs.start_ticks_of(pid)}").touch()
        listed = a.ok("kill_stale", dry_run=True)
        assert {c["pid"] for c in listed["candidates"]} == {as_smi, as_agent, recorded_with_context}, listed
        left = {e["holder"]["pid"]: e["reason"] for e in listed["left_alone"]}
        assert left[recorded].startswith("a specdec agent (recorded at its start"), left

        done = a.ok("kill_stale", dry_run=False, grace_s=2)
        assert sorted(e["pid"] for e in done["signalled"]) == sorted([as_smi, as_agent, recorded_with_context])
        assert not pid_alive(as_smi) and not pid_alive(as_agent) and pid_alive(recorded)
    finally:
        for p in started:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)


def test_a_driver_daemon_is_known_by_its_installed_executable_not_its_name(tmp_path: Path) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None
    real = os.path.realpath(sleep)
    copy = tmp_path / "nvidia-smi"
    shutil.copy(real, copy)
    started = [subprocess.Popen([real, "600"]), subprocess.Popen([str(copy), "600"])]
    try:
        from engine.protocol import HolderInfo

        installed, copied = (HolderInfo(pid=p.pid, resolved=True) for p in started)
        name = os.path.basename(real)
        if procs.system_binary(real):  # sleep, as installed, stands in for an installed nvidia-persistenced
            assert procs.by_design(installed, programs=frozenset({name})) is not None
        assert procs.by_design(copied, programs=frozenset({"nvidia-smi"})) is None  # a copy under its name: no
        assert procs.by_design(installed, programs=frozenset({"nvidia-smi"})) is None
    finally:
        for p in started:
            p.kill()
            p.wait(timeout=10)


def test_a_run_still_going_after_a_second_launch_became_current_is_never_stale(scene: Scene) -> None:
    """A second launch makes itself current (here one that fails at once, as a trainer refused by the first one's
    output_dir lock does) while the first run goes on. The first run's processes were then listed as stale holders,
    and `kill-stale --yes` would have ended a live run."""
    second = scene.agent.ok("launch", command=["false"])
    second_dir = Path(second["run_dir"])
    boot = procs.read_boot_id()
    wait_until(lambda: records.read_run(second_dir, boot).state == "failed", 20, "the second run to fail")
    assert records.current_run_dir(scene.run_dir.parent.parent) == second_dir
    assert records.read_run(scene.run_dir, boot).state == "running"

    res = scene.agent.ok("kill_stale", dry_run=True)
    assert {c["pid"] for c in res["candidates"]} == {scene.pids["stale"], scene.pids["stale_stubborn"]}
    left = {e["holder"]["pid"]: e["reason"] for e in res["left_alone"]}
    going = "part of another supervised run that is still going (not the current one; `runs` lists it)"
    assert left[scene.run_holder] == going
    run_ident = procs.proc_identity(scene.run_holder)
    assert run_ident is not None
    res = scene.agent.ok("kill_stale", dry_run=False, targets=[[run_ident[0], run_ident[1]]], grace_s=1.0)
    assert res["signalled"] == [] and [f["reason"] for f in res["failed"]] == [f"not a stale holder: {going}"]
    status = scene.agent.ok("status")
    stale = [a for a in status["anomalies"] if a["kind"] == "stale_holder"]
    assert {a["pid"] for a in stale} == {scene.pids["stale"]}, stale  # nvidiactl alone names no GPU: not flagged
    # `stop` with no run named acts on the current run, which has ended: it names the run still going, stops nothing.
    reply = scene.agent.request("stop", grace_s=1)
    assert not reply["ok"] and reply["error"] == (
        f"run {second_dir.name} is not running (failed): nothing to stop; still going here: {scene.run_dir.name} "
        "(stop --run ID stops one)"
    ), reply
    assert pid_alive(scene.run_holder)


def test_what_an_ended_run_left_behind_is_still_flagged_stale(scene: Scene) -> None:
    """Only runs that have not ended are protected (supervised_run_pids): a process the current run's job left
    holding a GPU after the job exited is a stale holder in the anomalies, as before."""
    hold = HOLD.format(ignore="").replace("\n", "; ")
    job = ["bash", "-c", f'{sys.executable} -c "$0" "$1" & sleep 1; exit 0', hold, str(scene.dev / "nvidia0")]
    launched = scene.agent.ok("launch", command=job)
    run_dir = Path(launched["run_dir"])
    boot = procs.read_boot_id()
    wait_until(lambda: records.read_run(run_dir, boot).state in ("exited", "failed"), 20, "the job to exit")

    def leftover() -> int | None:
        launch = records.read_json(run_dir / records.LAUNCH_JSON) or {}
        members = procs.group_members(launch.get("job_pgid") or 0, procs.all_stats())
        return next((pid for pid in members if holds(pid, scene.dev / "nvidia0")), None)

    left = leftover()
    if left is None:
        pytest.skip("the wrapper ended the job's process group with the job: nothing was left behind")
    try:
        stale = [a for a in scene.agent.ok("status")["anomalies"] if a["kind"] == "stale_holder"]
        assert left in {a["pid"] for a in stale}, stale
    finally:
        os.kill(left, signal.SIGKILL)
