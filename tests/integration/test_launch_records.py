"""Run records and the run's fate when its pieces die: ids, atomic records, read_run states, the wrapper's
signal forwarding, and waits that end because of a tmux pane, a vanished wrapper or a dead engine thread."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.agent import AgentClient, launch_and_wait
from support.procfs import pid_alive
from support.waiting import wait_until

from engine import protocol
from engine.host import procs
from engine.supervisor import launch, records, tmux, wait
from engine.supervisor.common import SupervisorError

pytestmark = pytest.mark.tmux


def test_generated_run_ids_are_valid_and_distinct() -> None:
    ids = {records.new_run_id() for _ in range(200)}
    assert len(ids) > 190
    for run_id in ids:
        assert protocol.validate_run_id(run_id) == run_id
        assert len(run_id) == len("20261129-113500-ab12")


@given(st.text(max_size=80))
def test_run_ids_that_could_escape_the_runs_directory_are_refused(text: str) -> None:
    try:
        protocol.validate_run_id(text)
    except protocol.RunIdError:
        return
    assert "/" not in text and "\0" not in text and text not in (".", "..") and not text.startswith(".")
    assert 1 <= len(text) <= 64 and text.isascii()


@pytest.mark.parametrize("bad", ["", ".", "..", "../x", "a/b", ".hidden", "-flag", "x" * 65, "sp ace", "tab\t"])
def test_known_bad_run_ids(bad: str) -> None:
    with pytest.raises(protocol.RunIdError):
        protocol.validate_run_id(bad)


def test_atomic_json_write_replaces_whole_files_and_leaves_no_temporaries(tmp_path: Path) -> None:
    target = tmp_path / "exit.json"
    for i in range(20):
        records.write_json_atomic(target, {"i": i, "pad": "x" * 1000 * i})
        assert records.read_json(target) == {"i": i, "pad": "x" * 1000 * i}
    assert [p.name for p in tmp_path.iterdir()] == ["exit.json"]
    (tmp_path / "half.json").write_text('{"exit_code": ')
    assert records.read_json(tmp_path / "half.json") is None
    assert records.read_json(tmp_path / "missing.json") is None


def test_current_link_follows_the_newest_run(tmp_path: Path) -> None:
    assert records.current_run_dir(tmp_path) is None
    a = records.run_dir_for(tmp_path, "run-a")
    b = records.run_dir_for(tmp_path, "run-b")
    a.mkdir(parents=True)
    b.mkdir()
    records.set_current(tmp_path, a)
    assert records.current_run_dir(tmp_path) == a
    records.set_current(tmp_path, b)
    assert records.current_run_dir(tmp_path) == b
    assert os.readlink(tmp_path / "current") == "runs/run-b"  # relative: the run root can move
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "runs"]


def test_read_run_says_rebooted_when_the_boot_id_differs(agent: AgentClient) -> None:
    launched, _, _ = launch_and_wait(agent, ["sleep", "600"], "started", 20)
    rd = Path(launched["run_dir"])
    assert records.read_run(rd, procs.read_boot_id()).state == "running"
    assert records.read_run(rd, "another-boot").state == "rebooted"


def test_wrapper_and_job_killed_without_a_trace_read_as_vanished_and_end_a_wait(agent: AgentClient) -> None:
    launched, _, _ = launch_and_wait(agent, ["sleep", "600"], "started", 20)
    rd = Path(launched["run_dir"])
    launch_rec = records.read_json(rd / records.LAUNCH_JSON) or {}
    cmd_id = agent.send("wait", milestone="output", timeout_s=30)
    os.kill(launch_rec["wrapper_pid"], signal.SIGKILL)  # no exit record can be written now
    assert records.read_run(rd, procs.read_boot_id()).state == "running"  # the job itself still runs
    os.killpg(launch_rec["job_pgid"], signal.SIGKILL)
    reply = agent.next_event(lambda e: e.get("ev") == "reply" and e.get("id") == cmd_id, 10)
    res = reply["result"]
    assert res["ok"] is False and res["alive"] is False
    assert "left no exit record" in res["cause"]
    assert records.read_run(rd, procs.read_boot_id()).state == "vanished"


def test_killing_the_tmux_session_ends_the_job_and_still_leaves_an_exit_record(agent: AgentClient) -> None:
    launched, _, _ = launch_and_wait(agent, ["sleep", "600"], "started", 20)
    rd = Path(launched["run_dir"])
    job_pid = records.read_run(rd, procs.read_boot_id()).pid
    assert job_pid is not None
    assert tmux.kill_session(launched["tmux_session"])  # SIGHUP to the pane: the wrapper forwards it
    exit_rec = wait_until(lambda: records.read_json(rd / records.EXIT_JSON), 10, "exit.json")
    assert exit_rec["signal"] == signal.SIGHUP and exit_rec["signal_name"] == "SIGHUP"
    assert [f["name"] for f in exit_rec["forwarded_signals"]] == ["SIGHUP"]
    assert not pid_alive(job_pid)


def test_a_finished_runs_tmux_session_stays_to_read_and_goes_at_the_next_launch(agent: AgentClient) -> None:
    """Every launch left a dead session behind (12 piled up on one server). The last run's dead pane stays (its
    end is on it, and `a` attaches to read it); the next launch closes the sessions of recorded, finished runs."""
    first, _, _ = launch_and_wait(agent, [sys.executable, "-c", "print('done')"], "started", 20)
    rd = Path(first["run_dir"])
    wait_until(lambda: records.read_json(rd / records.EXIT_JSON), 20, "exit.json")
    wait_until(lambda: (tmux.pane_state(first["tmux_session"]) or {}).get("dead"), 10, "the first run's pane to end")
    info = records.read_run(rd, procs.read_boot_id())
    assert info.state == "exited" and info.attachable
    second, _, _ = launch_and_wait(agent, [sys.executable, "-c", "import time; time.sleep(30)"], "started", 20)
    assert not tmux.has_session(first["tmux_session"])
    assert tmux.has_session(second["tmux_session"])  # a live run's session is never touched


def test_a_finished_runs_session_with_a_live_pane_of_the_users_is_left_at_the_next_launch(
    agent: AgentClient,
) -> None:
    first, _, _ = launch_and_wait(agent, [sys.executable, "-c", "print('done')"], "started", 20)
    session = first["tmux_session"]
    wait_until(lambda: (tmux.pane_state(session) or {}).get("dead"), 20, "the first run's pane to end")
    assert tmux.run("split-window", "-d", "-t", f"={session}:", "sleep 60").returncode == 0  # the user's pane
    try:
        launch_and_wait(agent, [sys.executable, "-c", "import time; time.sleep(30)"], "started", 20)
        assert tmux.has_session(session), "the next launch closed a session with a live pane in it"
    finally:
        tmux.kill_session(session)


def test_the_job_gets_the_run_environment_and_a_closed_stdin(agent: AgentClient, tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import json, os, sys
        keys = ["SPECDEC_RUN_DIR", "SPECDEC_EVENTS", "SPECDEC_RUN_ID", "MY_SETTING"]
        print(json.dumps({k: os.environ.get(k) for k in keys} | {"stdin": sys.stdin.read(), "cwd": os.getcwd(),
              "pgid_is_pid": os.getpgid(0) == os.getpid()}))
        """
    )
    launched, res, _ = launch_and_wait(
        agent, [sys.executable, "-c", script], "first-step", 20, env={"MY_SETTING": "42"}, cwd=str(tmp_path)
    )
    assert res["exit_code"] == 0
    seen = json.loads(res["last_lines"][-1])
    rd = launched["run_dir"]
    assert seen == {
        "SPECDEC_RUN_DIR": rd,
        "SPECDEC_EVENTS": f"{rd}/events.jsonl",
        "SPECDEC_RUN_ID": launched["run_id"],
        "MY_SETTING": "42",
        "stdin": "",
        "cwd": str(tmp_path),
        "pgid_is_pid": True,
    }
    assert "exited with code 0 before first-step" in res["cause"]


def test_a_dead_engine_thread_ends_the_wait_at_once(agent: AgentClient) -> None:
    script = textwrap.dedent(
        """
        import json, os, time
        with open(os.environ["SPECDEC_EVENTS"], "a") as fh:
            fh.write(json.dumps({"t": time.time(), "kind": "thread_error", "thread": "drafter-1",
                                 "exc_type": "RuntimeError", "message": "CUDA error: boom",
                                 "traceback": "Traceback ...", "policy": "stop"}) + "\\n")
        print("thread died", flush=True)
        time.sleep(600)
        """
    )
    _, res, elapsed = launch_and_wait(agent, [sys.executable, "-c", script], "first-step", 30)
    assert res["ok"] is False and res["alive"] is True
    assert res["cause"] == "thread drafter-1 died: RuntimeError: CUDA error: boom"
    assert res["hung"] is False  # a failure (exit 1), not a hang, although the process lives
    assert elapsed < 3.0


def test_a_wrapper_that_never_started_is_reported_from_its_dead_tmux_pane(tmp_path: Path) -> None:
    rd = records.run_dir_for(tmp_path, "never")
    rd.mkdir(parents=True)
    session = tmux.session_name("never")
    tmux.new_session(session, "echo no python here; exit 127")
    try:
        records.write_json_atomic(rd / records.SUBMITTED_JSON, {"t": time.time(), "tmux_session": session})
        t0 = time.monotonic()
        res = wait.wait_for(rd, "started", timeout_s=20)
        assert time.monotonic() - t0 < 3.0
        assert res.ok is False and res.alive is False
        assert res.cause == f"the wrapper never started: the tmux pane of session {session} exited with status 127"
    finally:
        tmux.kill_session(session)


def test_wrapper_output_milestone_ignores_what_was_in_the_log_before(tmp_path: Path) -> None:
    rd = tmp_path / "runs" / "pre"
    rd.mkdir(parents=True)
    (rd / "output.log").write_bytes(b"left over from an earlier attempt\n")
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"run_id": "pre", "spec": {"command": ["sleep", "0.3"], "cwd": str(tmp_path)}}))
    done = subprocess.run(
        [sys.executable, "-m", "engine.supervisor.wrapper", "--run-dir", str(rd), "--spec-json", str(spec)],
        cwd=Path(__file__).resolve().parents[2],
        timeout=30,
    )
    assert done.returncode == 0
    info = records.read_run(rd, procs.read_boot_id())
    assert info.state == "exited" and info.exit_code == 0
    assert info.milestones["started"] is not None and info.milestones["output"] is None


def test_a_setsid_wrapper_that_died_before_its_launch_record_ends_the_wait(tmp_path: Path) -> None:
    rd = records.run_dir_for(tmp_path, "never-setsid")
    rd.mkdir(parents=True)
    gone = subprocess.Popen(["sleep", "60"])
    ticks = procs.start_ticks_of(gone.pid)
    gone.kill()
    gone.wait()
    records.write_json_atomic(
        rd / records.SUBMITTED_JSON,
        {
            "t": time.time(),
            "tmux_session": None,
            "launcher_wrapper_pid": gone.pid,
            "launcher_wrapper_start_ticks": ticks,
        },
    )
    res = wait.wait_for(rd, "output", timeout_s=20)
    assert res.ok is False and res.alive is False
    assert res.cause == f"the wrapper never started: the wrapper (pid {gone.pid}, started with setsid) exited"
    assert res.elapsed_s < 2.0


def test_a_run_whose_agent_died_before_tmux_took_it_reads_starting_then_failed_with_the_cause(tmp_path: Path) -> None:
    rd = records.run_dir_for(tmp_path, "orphaned")
    rd.mkdir(parents=True)
    gone = subprocess.Popen(["sleep", "60"])  # the agent that was inside the launch
    ticks = procs.start_ticks_of(gone.pid)
    gone.kill()
    gone.wait()
    sub = {
        "phase": "submitting",
        "tmux_session": tmux.session_name("orphaned"),
        "launcher_pid": gone.pid,
        "launcher_start_ticks": ticks,
        "spec": {"command": ["sleep", "300"]},
    }
    boot = procs.read_boot_id()
    records.write_json_atomic(rd / records.SUBMITTED_JSON, {**sub, "t": time.time()})
    fresh = records.read_run(rd, boot)
    assert fresh.state == "starting" and fresh.cause is None  # tmux may still be creating the session
    records.write_json_atomic(rd / records.SUBMITTED_JSON, {**sub, "t": time.time() - records.STARTING_GRACE_S - 1})
    info = records.read_run(rd, boot)
    assert info.state == "failed" and info.exit_code is None and info.command == ["sleep", "300"]
    assert info.cause == (
        f"the wrapper never started: the agent (pid {gone.pid}) that launched it exited before tmux accepted "
        f"session {tmux.session_name('orphaned')}"
    )
    res = wait.wait_for(rd, "started", timeout_s=10)
    assert res.ok is False and res.cause == info.cause and res.elapsed_s < 2.0


def test_a_launch_is_recorded_and_current_before_its_job_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    seen: list[tuple[str | None, str | None, bool]] = []
    real_new_session = tmux.new_session

    def watching_new_session(name: str, shell_command: str) -> None:
        cur = records.current_run_dir(root)
        sub = records.read_json(cur / records.SUBMITTED_JSON) if cur is not None else None
        seen.append(
            (
                cur.name if cur else None,
                (sub or {}).get("phase"),
                records.read_run(cur, "x").state == "starting" if cur else False,
            )
        )
        real_new_session(name, shell_command)

    monkeypatch.setattr(tmux, "new_session", watching_new_session)
    launched = launch.launch({"command": ["true"], "run_id": "visible-first"}, root)
    try:
        assert seen == [("visible-first", "submitting", True)]
        assert (records.read_json(Path(launched["run_dir"]) / records.SUBMITTED_JSON) or {})["phase"] == "accepted"
    finally:
        tmux.kill_session(launched["tmux_session"])


def test_a_launch_tmux_refuses_leaves_no_run_and_the_previous_one_current(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    first = launch.launch({"command": ["true"], "run_id": "before"}, root)
    tmux.kill_session(first["tmux_session"])

    def refusing_new_session(name: str, shell_command: str) -> None:
        raise tmux.TmuxError(f"tmux new-session -s {name} failed: no server running on /nowhere")

    monkeypatch.setattr(tmux, "new_session", refusing_new_session)
    with pytest.raises(SupervisorError, match="could not start run refused: tmux new-session"):
        launch.launch({"command": ["true"], "run_id": "refused"}, root)
    assert not records.run_dir_for(root, "refused").exists()
    cur = records.current_run_dir(root)
    assert cur is not None and cur.name == "before"


def test_a_job_that_fills_the_run_roots_disk_still_gets_its_exit_record(tiny_tmpfs: Path) -> None:
    # os.write raises ENOSPC (exit 1); the wrapper's own records (milestones, its stderr) fail too, and the exit
    # record goes into the space reserved before the job started.
    fill = "import os\ndata = b'x' * 3_000_000\nwhile data:\n    data = data[os.write(1, data):]\n"
    launched = launch.launch({"command": [sys.executable, "-c", fill], "run_id": "fills"}, tiny_tmpfs / "root")
    rd = Path(launched["run_dir"])
    try:
        res = wait.wait_for(rd, "first-step", timeout_s=30)
        assert res.ok is False and res.exit_code == 1, res
        info = records.read_run(rd, procs.read_boot_id())
        assert info.state == "failed" and info.exit_code == 1 and info.signal is None
        rec = records.read_json(rd / records.EXIT_JSON) or {}
        assert rec.get("cause") == "exited with code 1"
        assert not (rd / records.EXIT_RESERVED).exists()
    finally:
        tmux.kill_session(launched["tmux_session"])


def test_the_reserved_exit_space_is_released_when_the_record_fits(tmp_path: Path) -> None:
    launched = launch.launch({"command": ["true"], "run_id": "fits"}, tmp_path / "root")
    rd = Path(launched["run_dir"])
    try:
        res = wait.wait_for(rd, "output", timeout_s=30)
        assert res.exit_code == 0
        assert (records.read_json(rd / records.EXIT_JSON) or {}).get("exit_code") == 0
        # the wrapper releases the reserve just after exit.json is in place (CI once looked in between)
        wait_until(lambda: not (rd / records.EXIT_RESERVED).exists(), 10, "the reserved exit space to go")
    finally:
        tmux.kill_session(launched["tmux_session"])
