"""Kill safety, randomized: kill_stale (the supervisor's, as the agent runs it) over >= 100 trials, each a fresh
random scene of real processes, never signals a decoy.

Stale holders are processes with an open descriptor on a stand-in ``nvidia*`` node under SPECDEC_DEV_DIR (what
/dev/nvidia* is on a GPU host). Decoys:
* a ``python3`` that holds no device (its identity is even passed as a target);
* a process of another user (created with useradd; holding no device, and holding one);
* a process whose PID was reused after the listed holder exited: real reuse, forced through
  /proc/sys/kernel/ns_last_pid when the kernel lets us (root), else the listed (pid, create_time) pointing
  at a live holder with another create time;
* a process of the current run that holds a device.
Every decoy traps SIGTERM into a canary file and SIGKILL would end it: a decoy alive, canary absent, proves
no signal reached it (another user's decoy cannot write the canary, so SIGTERM ends it: alive is the proof).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.procfs import pid_alive
from support.waiting import wait_until

from engine.host import procs
from engine.supervisor import kill_stale, launch, records

pytestmark = pytest.mark.tmux

TRIALS = 100
OTHER_USER = "specdec-adv"
# A decoy: traps SIGTERM into its canary file, then keeps living.
TRAP = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: open(sys.argv[1], 'w').close())\n"
    "while True: time.sleep(60)\n"
)


@dataclass
class Proc:
    role: str
    popen: subprocess.Popen[bytes]
    ident: tuple[int, float]
    canary: Path | None = None
    decoy: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.ident[0]


@pytest.fixture(scope="module")
def other_user() -> Iterator[pwd.struct_passwd | None]:
    """A second, unprivileged user for the foreign-process decoys (root only); None when not possible."""
    if os.geteuid() != 0 or shutil.which("useradd") is None or shutil.which("setpriv") is None:
        yield None
        return
    created = False
    try:
        pwd.getpwnam(OTHER_USER)
    except KeyError:
        done = subprocess.run(["useradd", "-r", "-M", "-s", "/usr/sbin/nologin", OTHER_USER], capture_output=True)
        created = done.returncode == 0
    try:
        yield pwd.getpwnam(OTHER_USER)
    except KeyError:
        yield None
    finally:
        if created:
            subprocess.run(["userdel", OTHER_USER], capture_output=True, check=False)


class Scene:
    def __init__(self, dev: Path, tmp: Path, user: pwd.struct_passwd | None) -> None:
        self.dev, self.tmp, self.user = dev, tmp, user
        self.procs: list[Proc] = []
        self.n = 0
        self.real_pid_reuse = 0
        self.simulated_pid_reuse = 0

    def _spawn(self, argv: list[str], hold: str | None, as_user: bool = False) -> subprocess.Popen[bytes]:
        stdin: Any = open(self.dev / hold, "rb") if hold else subprocess.DEVNULL  # noqa: SIM115
        if as_user:
            assert self.user is not None
            argv = ["setpriv", f"--reuid={self.user.pw_uid}", f"--regid={self.user.pw_gid}", "--clear-groups", *argv]
        try:
            return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            if hold:
                stdin.close()

    def add(self, role: str, *, hold: str | None, decoy: bool, trap: bool = True, as_user: bool = False) -> Proc:
        self.n += 1
        canary = self.tmp / f"canary-{self.n}" if trap else None
        argv = [sys.executable, "-c", TRAP, str(canary)] if trap else ["sleep", "600"]
        p = self._spawn(argv, hold, as_user)
        if hold:
            wait_until(lambda: _holds(p.pid, self.dev / hold), 10, f"{role} to hold {hold}")
        ident = wait_until(lambda: procs.proc_identity(p.pid), 5, "identity")
        if trap:
            # the trap is live once python has run its first line: wait for the handler to be installed
            wait_until(lambda: _catches_term(p.pid), 10, f"{role} to trap SIGTERM")
        proc = Proc(role, p, ident, canary, decoy)
        self.procs.append(proc)
        return proc

    def reused_pid_holder(self, hold: str) -> tuple[Proc, tuple[int, float]]:
        """A holder that exits; then a new holder under the same PID if the kernel lets us, else under another."""
        gone = self._spawn(["sleep", "600"], hold)
        wait_until(lambda: _holds(gone.pid, self.dev / hold), 10, "the first holder")
        listed = procs.proc_identity(gone.pid)
        assert listed is not None
        time.sleep(0.06)  # outlive the identity tolerance, so the listing is unambiguous
        gone.kill()
        gone.wait()
        for _ in range(5):
            with contextlib.suppress(OSError):
                Path("/proc/sys/kernel/ns_last_pid").write_text(str(listed[0] - 1))
            new = self.add("pid-reused holder", hold=hold, decoy=True)
            if new.pid == listed[0]:
                self.real_pid_reuse += 1
                return new, listed
            # Another process took the PID first (or no permission): keep this one only as a plain check.
            self._end(new)
            self.procs.remove(new)
        new = self.add("pid-reused holder (simulated)", hold=hold, decoy=True)
        self.simulated_pid_reuse += 1
        return new, (new.pid, listed[1])  # its PID with the exited holder's create time: a mismatched target

    @staticmethod
    def _end(p: Proc) -> None:
        if p.popen.poll() is None:
            p.popen.kill()
        p.popen.wait(timeout=10)

    def clear(self) -> None:
        for p in self.procs:
            self._end(p)
        self.procs.clear()


def _holds(pid: int, path: Path) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == str(path) for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def _catches_term(pid: int) -> bool:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        return False
    return False


@pytest.fixture
def dev_and_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Path, int]]:
    """Stand-in device nodes, a run root whose current run holds nvidia1, and that holder's pid."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidia2", "nvidiactl"):
        (dev / name).write_text("")
    monkeypatch.setenv("SPECDEC_DEV_DIR", str(dev))
    root = tmp_path / "run-root"
    root.mkdir()
    hold = f"import time; f = open({str(dev / 'nvidia1')!r}); time.sleep(600)"
    launched = launch.launch({"command": [sys.executable, "-c", hold], "run_id": "kill-safety-run"}, root)
    rd = Path(launched["run_dir"])

    def run_holder() -> int | None:
        launch_rec = records.read_json(rd / records.LAUNCH_JSON) or {}
        for pid in procs.tree_pids(launch_rec.get("job_pid") or 0):
            if _holds(pid, dev / "nvidia1"):
                return pid
        return None

    holder = wait_until(run_holder, 20, "the run's job to hold nvidia1")
    try:
        yield dev, root, holder
    finally:
        launch_rec = records.read_json(rd / records.LAUNCH_JSON) or {}
        if isinstance(launch_rec.get("job_pgid"), int) and pid_alive(launch_rec["job_pid"]):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launch_rec["job_pgid"], signal.SIGKILL)
        subprocess.run(
            ["tmux", "-L", os.environ["SPECDEC_TMUX_SOCKET"], "kill-session", "-t", "=specdec-kill-safety-run"],
            capture_output=True,
            check=False,
        )


def _run_trials(
    dev: Path, root: Path, run_holder: int, tmp: Path, user: pwd.struct_passwd | None, foreign_holders: bool
) -> dict[str, Any]:
    rnd = random.Random(20261129)
    scene = Scene(dev, tmp, user)
    run_ident = procs.proc_identity(run_holder)
    stats: dict[str, Any] = {"trials": 0, "stale_killed": 0, "decoys": 0, "targets_refused": 0}
    nodes = ["nvidia0", "nvidia2", "nvidiactl"]
    try:
        for trial in range(TRIALS):
            stale = [
                scene.add("stale holder", hold=rnd.choice(nodes), decoy=False, trap=False)
                for _ in range(rnd.randint(0, 2))
            ]
            decoys: list[Proc] = [scene.add("python3 holding nothing", hold=None, decoy=True)]
            listed_reused: tuple[int, float] | None = None
            if rnd.random() < 0.5:
                reused, listed_reused = scene.reused_pid_holder(rnd.choice(nodes))
                decoys.append(reused)
            if user is not None:
                decoys.append(scene.add("other user's process", hold=None, decoy=True, as_user=True))
                if foreign_holders:
                    decoys.append(scene.add("other user's holder", hold=rnd.choice(nodes), decoy=True, as_user=True))
            # The client's view: targets are the listed stale holders, plus (adversarially) decoy identities.
            mode = rnd.choice(["listed", "listed+decoys", "all"])
            targets: list[list[float]] | None = None
            if mode != "all":
                targets = [[p.ident[0], p.ident[1]] for p in stale]
                if mode == "listed+decoys":
                    targets += [[d.ident[0], d.ident[1]] for d in decoys if d.role != "pid-reused holder"]
                    if run_ident is not None:
                        targets.append([run_ident[0], run_ident[1]])
                if listed_reused is not None:
                    targets.append([listed_reused[0], listed_reused[1]])
                rnd.shuffle(targets)
            elif listed_reused is not None and not foreign_holders:
                pass  # "all" signals every current candidate: a reused-PID holder is then simply a new stale one
            if mode == "all" and listed_reused is not None:
                # With no target list, the reused-PID process is a fresh stale holder, legitimately a candidate.
                decoys = [d for d in decoys if not d.role.startswith("pid-reused")]
                for p in scene.procs:
                    if p.role.startswith("pid-reused") and p.popen.poll() is None:
                        p.decoy = False
            res = kill_stale.kill_stale(root, dry_run=False, targets=targets, grace_s=0.5)
            signalled = {int(e["pid"]) for e in res["signalled"]}
            for d in decoys:
                stats["decoys"] += 1
                assert d.pid not in signalled, f"trial {trial}: {d.role} pid {d.pid} was signalled: {res['signalled']}"
                assert d.popen.poll() is None and pid_alive(d.pid), f"trial {trial}: {d.role} is gone"
                assert d.canary is None or not d.canary.exists(), f"trial {trial}: {d.role} got SIGTERM"
                assert procs.proc_identity(d.pid) == d.ident
            assert run_ident is not None and procs.proc_identity(run_holder) == run_ident, "the run's holder"
            for s in stale:
                assert s.pid in signalled, f"trial {trial}: stale holder {s.pid} not signalled: {res}"
                s.popen.wait(timeout=10)
                stats["stale_killed"] += 1
            stats["targets_refused"] += len(res["failed"])
            stats["trials"] += 1
            scene.clear()
    finally:
        scene.clear()
    stats["real_pid_reuse"] = scene.real_pid_reuse
    stats["simulated_pid_reuse"] = scene.simulated_pid_reuse
    return stats


@pytest.mark.slow
def test_kill_stale_never_signals_a_decoy_in_100_random_trials(
    dev_and_run: tuple[Path, Path, int], tmp_path: Path, other_user: pwd.struct_passwd | None
) -> None:
    dev, root, run_holder = dev_and_run
    stats = _run_trials(dev, root, run_holder, tmp_path, other_user, foreign_holders=False)
    assert stats["trials"] == TRIALS and stats["stale_killed"] > 50 and stats["decoys"] >= 2 * TRIALS
    if other_user is None:
        print("\n[adversarial] other-user decoys skipped: needs root with useradd and setpriv")
    print(f"\n[adversarial] kill-safety: {stats}")


def test_kill_stale_never_signals_another_users_process_even_one_holding_a_gpu(
    dev_and_run: tuple[Path, Path, int], tmp_path: Path, other_user: pwd.struct_passwd | None
) -> None:
    """A colleague's job on a shared box holds a GPU too: kill-stale only lists and signals our own user's."""
    if other_user is None:
        pytest.skip("needs root with useradd and setpriv to run a process as another user")
    if os.geteuid() != 0:
        pytest.skip("only root could signal another user's process at all")
    dev, root, _ = dev_and_run
    scene = Scene(dev, tmp_path, other_user)
    try:
        theirs = scene.add("other user's holder", hold="nvidia0", decoy=True, as_user=True)
        ours = scene.add("our stale holder", hold="nvidia2", decoy=False, trap=False)
        listed = kill_stale.kill_stale(root, dry_run=True)
        assert ours.pid in {h.pid for h in listed["candidates"]}
        res = kill_stale.kill_stale(root, dry_run=False, targets=None, grace_s=0.5)
        signalled = {int(e["pid"]) for e in res["signalled"]}
        assert theirs.pid not in signalled, f"another user's GPU process was signalled: {res['signalled']}"
        assert theirs.popen.poll() is None and theirs.canary is not None and not theirs.canary.exists()
    finally:
        scene.clear()


def test_a_pid_reused_a_few_ticks_after_the_listed_holder_started_is_not_signalled(
    dev_and_run: tuple[Path, Path, int], tmp_path: Path
) -> None:
    if not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("forcing a PID reuse needs a writable /proc/sys/kernel/ns_last_pid (root)")
    dev, root, _ = dev_and_run
    scene = Scene(dev, tmp_path, None)
    try:
        for _ in range(20):
            gone = scene._spawn(["sleep", "600"], "nvidia0")
            listed = wait_until(lambda g=gone: procs.proc_identity(g.pid), 5, "identity")
            time.sleep(0.025)  # the listed holder lives 2-3 clock ticks
            gone.kill()
            gone.wait()
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(listed[0] - 1))
            new = scene._spawn(["sleep", "600"], "nvidia0")
            ident = wait_until(lambda n=new: procs.proc_identity(n.pid), 5, "identity")
            if new.pid == listed[0] and ident[1] != listed[1]:
                break
            new.kill()
            new.wait()
        else:
            pytest.skip("could not get the PID reused (a busy host took it first every time)")
        assert 0.0 < ident[1] - listed[1] <= 0.05
        wait_until(lambda: _holds(new.pid, dev / "nvidia0"), 5, "the new process to hold the device")
        res = kill_stale.kill_stale(root, dry_run=False, targets=[[listed[0], listed[1]]], grace_s=0.5)
        try:
            assert new.pid not in {int(e["pid"]) for e in res["signalled"]}, res["signalled"]
            assert new.poll() is None
        finally:
            new.kill()
            new.wait()
    finally:
        scene.clear()
