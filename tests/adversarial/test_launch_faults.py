"""Faults around a run: the client killed in the middle of a launch, a reboot between launch and status,
the run root's disk filling up, and the log rotated or truncated while a session follows it.

Real parts throughout: the agent (a subprocess, or the CLI's own), the supervisor's wrapper in a private
tmux server, a real 1 MiB tmpfs for the full disk, real files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.agent import AgentClient, end_runs
from support.procfs import pid_alive
from support.waiting import wait_until, wait_until_async

from engine import protocol
from engine.host import procs
from engine.supervisor import records, tmux
from tui.link.events import ClientEvent
from tui.link.session import ConnectOptions, open_session

pytestmark = pytest.mark.tmux
REPO_ROOT = Path(__file__).resolve().parents[2]


# A slow host: the real tmux, but `new-session` returns only after SLOW_TMUX_S, so the agent is still inside
# the launch (the session and its job already exist) when its client vanishes. Other tmux calls pass through.
SLOW_TMUX_S = 1.5
SLOW_TMUX = """#!/bin/sh
{real} "$@"
rc=$?
case " $* " in *" new-session "*) sleep {delay} ;; esac
exit $rc
"""


@pytest.fixture(scope="module")
def slow_tmux_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    real = shutil.which("tmux")
    if real is None:
        pytest.skip("tmux not installed")
    d = tmp_path_factory.mktemp("slow-tmux")
    shim = d / "tmux"
    shim.write_text(SLOW_TMUX.format(real=real, delay=SLOW_TMUX_S))
    shim.chmod(0o755)
    return f"{d}{os.pathsep}{os.environ.get('PATH', '')}"


def _settled(run_root: Path) -> bool:
    """Every run directory has either a launch record or no tmux session that could still write one."""
    for rd in records.list_runs(run_root):
        if (rd / records.LAUNCH_JSON).exists():
            continue
        if tmux.has_session(tmux.session_name(rd.name)):
            return False
    return True


def _live_runs(run_root: Path, boot_id: str) -> set[str]:
    """Run ids whose job exists now: a live process per its launch record, or a tmux session of its own."""
    live: set[str] = set()
    for rd in records.list_runs(run_root):
        info = records.read_run(rd, boot_id)
        if info.state == "running" or tmux.has_session(tmux.session_name(rd.name)):
            live.add(rd.name)
    return live


def _status_run(run_root: Path) -> dict[str, Any] | None:
    """`status` from a fresh agent (stdin kept open until the reply: the agent drops work in flight at EOF)."""
    agent = AgentClient(run_root)
    try:
        run = agent.ok("status")["run"]
    finally:
        agent.close(timeout_s=30)
    return run if isinstance(run, dict) else None


def _check_never_half_started(run_root: Path, boot_id: str) -> str:
    """The invariant: what runs is what the next `status` shows. Returns 'started' or 'nothing'."""
    wait_until(lambda: _settled(run_root), 10, "the wrapper of an accepted launch to write its record")
    live = _live_runs(run_root, boot_id)
    run = _status_run(run_root)
    if not live:
        return "nothing" if run is None or run["state"] not in ("starting", "running") else "started"
    assert run is not None, f"runs {sorted(live)} are alive but status shows no run: half-started and invisible"
    assert live == {run["run_id"]}, f"alive {sorted(live)}, status shows {run['run_id']}"
    assert run["state"] == "running", run
    return "started"


@pytest.fixture
def ended_runs(run_root: Path) -> Iterator[Path]:
    yield run_root
    end_runs(run_root)


def _session_exists(run_root: Path) -> bool:
    return any(tmux.has_session(tmux.session_name(rd.name)) for rd in records.list_runs(run_root))


def test_agent_losing_its_client_while_tmux_accepts_the_launch_never_leaves_an_invisible_run(
    ended_runs: Path, slow_tmux_path: str
) -> None:
    root = ended_runs
    boot_id = procs.read_boot_id()
    agent = AgentClient(root, env={"PATH": slow_tmux_path})
    agent.send("launch", command=["sleep", "300"], run_id="mid-launch")
    wait_until(lambda: _session_exists(root), 10, "tmux to accept the session")
    agent.close(timeout_s=30)  # the client is gone while the agent is inside the launch
    assert _check_never_half_started(root, boot_id) in ("started", "nothing")


@pytest.mark.slow
def test_cli_killed_at_each_point_of_a_launch_leaves_a_run_started_and_found_or_nothing(
    ended_runs: Path, tmp_path: Path, slow_tmux_path: str
) -> None:
    """`specdec-tui launch` SIGKILLed at each observable point: before the run directory exists, once it exists,
    once tmux holds the session (inside the agent's launch), once the job's record is written, once current is set."""
    boot_id = procs.read_boot_id()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PATH": slow_tmux_path}
    points: dict[str, Callable[[Path], bool]] = {
        "at once": lambda r: True,
        "run dir made": lambda r: bool(records.list_runs(r)),
        "tmux session": _session_exists,
        "launch.json": lambda r: any((rd / records.LAUNCH_JSON).exists() for rd in records.list_runs(r)),
        "current set": lambda r: records.current_run_dir(r) is not None,
    }
    outcomes: dict[str, str] = {}
    failures: list[str] = []
    for i, (point, reached) in enumerate(points.items()):
        root = tmp_path / f"root{i}"
        root.mkdir()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tui", "launch", "local", "--run-root", str(root), "--wait", "started",
                 "--json", "--", "sleep", "300"],
                env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
            wait_until(
                lambda r=root, f=reached, p=proc: f(r) or p.poll() is not None, 30, f"the launch to reach '{point}'"
            )
            proc.kill()
            proc.communicate(timeout=30)
            wait_until(lambda r=root: not _agents_alive_for(r), 10, "the orphaned agent to exit")
            try:
                outcomes[point] = _check_never_half_started(root, boot_id)
            except AssertionError as exc:
                outcomes[point] = "INVISIBLE"
                failures.append(f"killed at '{point}': {exc}")
        finally:
            end_runs(root)
    print(f"\n[adversarial] CLI killed mid-launch: {outcomes}")
    assert not failures, failures


def _agents_alive_for(root: Path) -> bool:
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{d}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"engine.agent.main" in cmd and str(root).encode() in cmd and pid_alive(int(d)):
            return True
    return False


def test_run_from_before_a_reboot_reads_rebooted_even_if_its_pid_is_alive_now(
    cli: Callable[..., Any], run_root: Path
) -> None:
    run_id = "before-reboot"
    rd = records.run_dir_for(run_root, run_id)
    rd.mkdir(parents=True)
    live = subprocess.Popen(["sleep", "60"])  # after a reboot the old pid may well name a live process
    try:
        records.write_json_atomic(
            rd / records.LAUNCH_JSON,
            {
                "run_id": run_id,
                "command": ["python3", "train.py"],
                "cwd": "/",
                "job_pid": live.pid,
                "job_pgid": live.pid,
                "wrapper_pid": live.pid,
                "boot_id": "00000000-dead-beef-0000-000000000000",
                "started_at": time.time() - 3600,
                "job_start_ticks": procs.start_ticks_of(live.pid),
            },
        )
        (rd / records.OUTPUT_LOG).write_text("step=1\n")
        records.set_current(run_root, rd)
        r = cli("status", "local", "--run-root", str(run_root), "--json", "--simulate-gpus", "1")
        assert r.returncode == 0, r.output
        run = json.loads(r.stdout)["run"]
        assert run["run_id"] == run_id and run["state"] == "rebooted", run
        human = cli("status", "local", "--run-root", str(run_root), "--simulate-gpus", "1")
        assert "reboot" in human.stdout.lower(), human.stdout
        # Nothing may act on a pid recorded before the reboot: stop refuses, the live process is untouched.
        stop = cli("stop", "local", "--run-root", str(run_root), "--grace", "1")
        assert stop.returncode != 0, stop.output
        assert live.poll() is None
    finally:
        live.kill()
        live.wait()


# -- log rotation and truncation, through a session ------------------------------------------------------

# Appends numbered lines to $SPECDEC_RUN_DIR/output.log, reopening the path for every batch (a logger that
# survives rotation). While PAUSE exists it writes nothing and says so by creating PAUSE.ack.
ROTATING_WRITER = r"""
import os, sys, time
pause, stop = sys.argv[1], sys.argv[2]
path = os.path.join(os.environ["SPECDEC_RUN_DIR"], "output.log")
i = 0
while not os.path.exists(stop):
    if os.path.exists(pause):
        open(pause + ".ack", "w").close()
        time.sleep(0.005)
        continue
    if os.path.exists(pause + ".ack"):
        os.unlink(pause + ".ack")
    with open(path, "ab") as fh:
        fh.write(b"".join(b"%08d rotating line \xff\x00 \xe2\x82\xac\n" % k for k in range(i, i + 50)))
    i += 50
    time.sleep(0.005)
"""


class _Files:
    """Client side: every followed file rebuilt from log/log_reset events (inode -> bytes)."""

    def __init__(self) -> None:
        self.files: dict[int, bytearray] = {}
        self.resets: list[str] = []
        self.problems: list[str] = []
        self.received = 0

    def __call__(self, ev: ClientEvent) -> None:
        if isinstance(ev, protocol.LogResetEvent):
            self.resets.append(ev.reason)
            buf = self.files.setdefault(ev.inode, bytearray())
            del buf[ev.offset :]
        elif isinstance(ev, protocol.LogEvent):
            buf = self.files.setdefault(ev.inode, bytearray())
            if ev.offset != len(buf):
                self.problems.append(f"inode {ev.inode}: event at {ev.offset}, have {len(buf)}")
                return
            data = ev.raw
            buf.extend(data)
            self.received += len(data)


async def test_rotation_and_truncation_while_a_session_follows_lose_and_repeat_nothing(
    ended_runs: Path, tmp_path: Path
) -> None:
    root = ended_runs
    pause, stop = tmp_path / "pause", tmp_path / "stop"
    session = open_session("local", ConnectOptions(run_root=str(root), python=sys.executable, connect_timeout_s=5.0))
    got = _Files()
    session.add_event_listener(got)
    await session.connect()
    try:
        await session.start_streams(gpu_interval_s=1.0, procs_interval_s=1.0)
        launched = await session.request(
            "launch", timeout_s=60.0, command=[sys.executable, "-c", ROTATING_WRITER, str(pause), str(stop)]
        )
        log = Path(launched["run_dir"]) / records.OUTPUT_LOG

        async def quiesce() -> None:
            pause.touch()
            await wait_until_async(lambda: (tmp_path / "pause.ack").exists(), 10, "the writer to pause")
            await wait_until_async(
                lambda: len(got.files.get(log.stat().st_ino, b"")) == log.stat().st_size, 10, "catch-up"
            )

        await wait_until_async(lambda: got.received > 20_000, 20, "the log to flow")
        kept: dict[int, Path] = {}
        for cycle in range(3):
            # copytruncate: copy the file away, cut it to nothing while the writer is paused, resume.
            await quiesce()
            ino = log.stat().st_ino
            (tmp_path / f"copy{cycle}").write_bytes(log.read_bytes())
            n_resets = len(got.resets)
            os.truncate(log, 0)
            # The writer resumes once the cut was seen: a file that regrows past the follower's offset before
            # its next poll is indistinguishable from one that grew (the limit of any offset-based follower).
            await wait_until_async(lambda n=n_resets: len(got.resets) > n, 10, "the truncation to reach the client")
            assert got.resets[-1] == "truncated"
            pause.unlink()
            await wait_until_async(lambda i=ino: len(got.files.get(i, b"")) > 5_000, 10, "lines after the truncation")
            # rename rotation: the old file moves away whole, the writer's next batch creates a new one.
            await quiesce()
            old = log.with_name(f"output.log.{cycle}")
            os.rename(log, old)
            kept[old.stat().st_ino] = old
            pause.unlink()
            await wait_until_async(
                lambda: log.exists() and log.stat().st_size > 5_000, 10, "the writer to start a new file"
            )
            await wait_until_async(
                lambda: got.resets[-1] in ("rotated", "created"), 10, "the rotation to reach the client"
            )
        await quiesce()
        stop.touch()
    finally:
        stop.touch()
        await session.close()
    assert not got.problems, got.problems[:5]
    assert bytes(got.files[log.stat().st_ino]) == log.read_bytes()
    for ino, path in kept.items():
        assert bytes(got.files.get(ino, b"")) == path.read_bytes(), f"{path.name} differs"
    assert got.resets.count("truncated") == 3 and len(got.resets) >= 6, got.resets
    print(f"\n[adversarial] 3 truncations + 3 rotations followed: {got.received} bytes, resets {got.resets}")


# -- disk full on the run root ------------------------------------------------------------------------------

FILLER = "import sys, time\nsys.stdout.write('x' * 3_000_000)\nsys.stdout.flush()\ntime.sleep(60)\n"


@pytest.fixture
def full_disk_root(tiny_tmpfs: Path) -> Iterator[Path]:
    """A run root on its own 1 MiB tmpfs; its runs are ended before the tmpfs goes."""
    root = tiny_tmpfs / "run-root"
    root.mkdir()
    try:
        yield root
    finally:
        end_runs(root)


def _fill(cli: Callable[..., Any], root: Path) -> str:
    r = cli(
        "launch", "local", "--run-root", str(root), "--wait", "started", "--json", "--", sys.executable, "-c", FILLER
    )
    assert r.returncode == 0, r.output
    run_id = str(json.loads(r.stdout)["run_id"])
    wait_until(lambda: shutil.disk_usage(root).free < 8192, 20, "the job to fill the run root's filesystem")
    return run_id


def test_disk_full_on_the_run_root_is_a_clear_error_and_the_run_is_still_reported(
    cli: Callable[..., Any], full_disk_root: Path
) -> None:
    root = full_disk_root
    run_id = _fill(cli, root)
    snap = json.loads(cli("status", "local", "--run-root", str(root), "--json").stdout)
    assert snap["run"] is not None and snap["run"]["run_id"] == run_id, snap["run"]
    assert snap["run"]["state"] in ("running", "failed", "vanished"), snap["run"]
    full = [a for a in snap["anomalies"] if a["kind"] == "disk_full"]
    assert full and str(root) in full[0]["message"] and "full" in full[0]["message"], snap["anomalies"]
    human = cli("status", "local", "--run-root", str(root))
    assert "disk_full" in human.stdout and run_id in human.stdout, human.stdout
    # A launch onto the full disk is refused with the reason, and the run before it is still the one reported.
    again = cli("launch", "local", "--run-root", str(root), "--wait", "started", "--json", "--", "sleep", "30")
    assert again.returncode == 1, again.output
    cause = json.loads(again.stdout)["cause"]
    assert "No space left on device" in cause, cause
    after = json.loads(cli("status", "local", "--run-root", str(root), "--json").stdout)
    assert after["run"]["run_id"] == run_id
    assert _live_runs(root, procs.read_boot_id()) <= {run_id}


def test_a_job_killed_by_a_full_disk_is_reported_failed_with_its_exit_code(
    cli: Callable[..., Any], full_disk_root: Path
) -> None:
    root = full_disk_root
    r = cli(
        "launch",
        "local",
        "--run-root",
        str(root),
        "--wait",
        "started",
        "--json",
        "--",
        sys.executable,
        "-c",
        "import os\nwhile True:\n    os.write(1, b'x' * 65536)\n",
    )  # fmt: skip  (ENOSPC raises: exit 1)
    assert r.returncode == 0, r.output
    run_id = str(json.loads(r.stdout)["run_id"])

    def ended() -> dict[str, Any] | None:
        run = json.loads(cli("status", "local", "--run-root", str(root), "--json").stdout)["run"]
        return run if run["state"] != "running" else None

    run = wait_until(ended, 30, "the job to end")
    assert run["run_id"] == run_id
    assert run["state"] == "failed" and run["exit_code"] not in (None, 0), run
