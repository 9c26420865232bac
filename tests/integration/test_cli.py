"""The `specdec-tui` command line over the local transport: the documented contracts, exit codes, profiles."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_until, wait_until_async

from tui.link import ship
from tui.link.events import ClientEvent, ConnectionEvent
from tui.link.session import Session
from tui.link.transport import ConnectOptions, LocalTransport, Target, pct_wrap, remote_command
from tui.profiles import ProfileError, resolve_profile

Cli = Callable[..., Any]
REPO = Path(__file__).resolve().parents[2]


def test_status_json_with_eight_simulated_gpus(cli: Cli, run_root: Path) -> None:
    r = cli("status", "local", "--simulate-gpus", "8", "--json", "--run-root", str(run_root))
    assert r.returncode == 0, r.output
    snap = json.loads(r.stdout)
    assert set(snap) >= {"host", "gpus", "processes", "run", "anomalies"}
    assert len(snap["gpus"]) == 8
    assert all(g["simulated"] and g["util_pct"] is not None and g["mem_total_mib"] > 0 for g in snap["gpus"])
    assert snap["simulated"] is True and snap["run"] is None and isinstance(snap["anomalies"], list)


def test_status_human_output_labels_simulated_gpus(cli: Cli, run_root: Path) -> None:
    r = cli("status", "local", "--simulate-gpus", "2", "--run-root", str(run_root))
    assert r.returncode == 0, r.output
    assert "SIMULATED" in r.stdout and r.stdout.count("[sim]") == 2


def test_status_without_nvml_says_why_and_exits_0(cli: Cli, run_root: Path) -> None:
    r = cli("status", "local", "--json", "--run-root", str(run_root))
    snap = json.loads(r.stdout)
    if not snap.get("nvml_error"):
        pytest.skip("this machine has working NVML")
    r = cli("status", "local", "--run-root", str(run_root))
    assert r.returncode == 0, r.output
    assert f"NVML unavailable: {snap['nvml_error']}" in r.stdout


@pytest.mark.parametrize(
    "argv",
    [
        ["bogus", "local"],
        ["status"],
        ["status", "local", "--port", "99999"],
        ["status", "-x"],
        ["kill-stale", "local"],
        ["kill-stale", "local", "--dry-run", "--yes"],
        ["launch", "local", "--wait", "forever"],
        ["status", "local", "--", "echo", "hi"],
        ["status", "user@"],
        ["stacks", "local", "--timeout", "0"],
        ["status", "local", "--simulate-gpus", "65"],
    ],
    ids=lambda a: " ".join(a),
)
def test_usage_errors_exit_2(cli: Cli, argv: list[str]) -> None:
    r = cli(*argv)
    assert r.returncode == 2, r.output
    assert "Traceback" not in r.output


def test_a_verb_that_reads_no_profile_still_refuses_a_bad_one_and_a_run_root_that_is_a_file(
    cli: Cli, tmp_path: Path
) -> None:
    """`status --profile nosuch` and `--config BAD` were ignored (exit 0); `--run-root FILE` reported "run none"."""
    afile = tmp_path / "afile"
    afile.write_text("")
    bad = tmp_path / "bad.toml"
    bad.write_text("x = [\n")
    for argv, words in (
        (["--profile", "nosuch"], "no such profile: nosuch (--profile)"),
        (["--config", str(bad)], f"{bad}: not valid TOML"),
        (["--run-root", str(afile)], f"--run-root {afile} is not a directory"),
    ):
        for verb in ("status", "doctor"):
            r = cli(verb, "local", *argv)
            assert r.returncode == 2, (verb, argv, r.output)
            assert words in r.stderr.splitlines()[-1] and "Traceback" not in r.output, r.output


def test_bad_profile_file_exits_2_naming_file_and_key(cli: Cli, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text('[profiles.demo]\ncommand = "bash run.sh"\n')
    r = cli("launch", "local", "--config", str(cfg), "--profile", "demo")
    assert r.returncode == 2, r.output
    assert str(cfg) in r.stderr and "profiles.demo.command" in r.stderr and "list of strings" in r.stderr


def test_profile_errors_name_what_is_allowed(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text("[profiles.a]\ndeadlines_s = { begun = 3 }\n")
    with pytest.raises(ProfileError, match=r"profiles\.a\.deadlines_s\.begun: unknown milestone; allowed: submitted"):
        resolve_profile("a", str(cfg))
    cfg.write_text("[profiles.a]\nstep_pattern = '('\n")
    with pytest.raises(ProfileError, match="not a valid regular expression"):
        resolve_profile("a", str(cfg))
    cfg.write_text("[profiles.a]\ncwdd = '/x'\n")
    with pytest.raises(ProfileError, match="unknown key; allowed: command, cwd, deadlines_s, engine, env"):
        resolve_profile("a", str(cfg))
    cfg.write_text("[profiles.a]\ncwd = '/x'\n")
    with pytest.raises(ProfileError, match="no such profile"):
        resolve_profile("nope", str(cfg))
    with pytest.raises(ProfileError, match="no such config file"):
        resolve_profile(None, str(tmp_path / "missing.toml"))


def test_an_unknown_profile_without_a_config_file_says_there_is_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It named the default config path as if that file existed and lacked the profile."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    missing = tmp_path / "xdg" / "specdec-tui" / "config.toml"
    with pytest.raises(ProfileError) as caught:
        resolve_profile("big", None)
    said = str(caught.value)
    assert not said.startswith(str(missing)), said
    assert f"no config file defines profiles here ({missing} does not exist" in said and "no such profile: big" in said


def test_default_profile_starts_the_engine_cpu_preset() -> None:
    prof = resolve_profile(None, None) if not os.environ.get("XDG_CONFIG_HOME") else resolve_profile("default", None)
    spec = prof.launch_spec(None, python="/usr/bin/python3", engine_pythonpath="/opt/bundle")
    assert spec.command == ["/usr/bin/python3", "-m", "engine.trainer", "--preset", "cpu-demo"]
    assert spec.env["PYTHONPATH"] == "/opt/bundle" and spec.step_pattern == r"step=\d+"


def test_launch_follows_the_profile(cli: Cli, run_root: Path, tmp_path: Path) -> None:
    work = tmp_path / "work dir"
    work.mkdir()
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        "[profiles.mine]\n"
        f"command = [{json.dumps(sys.executable)}, '-c', 'import os; print(\"iter 7 \" + os.environ[\"GREETING\"])']\n"
        f"cwd = {json.dumps(str(work))}\n"
        "env = { GREETING = 'hello there' }\n"
        "step_pattern = 'iter \\d+'\n"
        "deadlines_s = { first-step = 20 }\n"
    )
    r = cli(
        "launch", "local", "--config", str(cfg), "--profile", "mine", "--run-root", str(run_root),
        "--wait", "first-step", "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["ok"] is True and obj["milestone"] == "first-step"
    launch = json.loads((run_root / "runs" / obj["run_id"] / "launch.json").read_text())
    assert launch["cwd"] == str(work)
    assert "iter 7 hello there" in (run_root / "runs" / obj["run_id"] / "output.log").read_text()


def test_launch_human_output_shows_milestones_and_the_failure(cli: Cli, run_root: Path) -> None:
    r = cli("launch", "local", "--run-root", str(run_root), "--wait", "first-step", "--", "bash", "/does/not/exist.sh")
    assert r.returncode == 1, r.output
    for milestone in ("submitted", "started", "output"):
        assert f"✓ {milestone}" in r.stdout
    assert "exit code 127" in r.stdout and "No such file or directory" in r.stdout


def test_launch_of_a_silent_process_exits_4_and_stop_ends_it(cli: Cli, run_root: Path) -> None:
    r = cli(
        "launch", "local", "--run-root", str(run_root), "--wait", "output", "--timeout", "2", "--json",
        "--", "sleep", "600",
    )  # fmt: skip
    try:
        assert r.returncode == 4, r.output
        obj = json.loads(r.stdout)
        assert obj["ok"] is False and obj["alive"] is True and obj["exit_code"] is None
        assert r.elapsed_s < 5.0
    finally:
        stop = cli("stop", "local", "--run-root", str(run_root), "--grace", "2")
    assert stop.returncode == 0, stop.output
    assert "SIGTERM" in stop.stdout and "stopped" in stop.stdout


def test_launch_without_a_command_starts_the_engine(cli: Cli, run_root: Path) -> None:
    r = cli("launch", "local", "--run-root", str(run_root), "--wait", "started", "--json")
    try:
        assert r.returncode == 0, r.output
        launch = json.loads((run_root / "runs" / json.loads(r.stdout)["run_id"] / "launch.json").read_text())
        assert launch["command"][1:] == ["-m", "engine.trainer", "--preset", "cpu-demo"]
    finally:
        cli("stop", "local", "--run-root", str(run_root), "--grace", "5")


README_EXPORT = "specdec-train export ~/.specdec/engine/runs/cpu-demo /tmp/cpu-demo-drafters"


@pytest.mark.slow
def test_the_engines_output_directory_is_named_by_status_and_runs_and_the_readme_export_works(
    cli: Cli, tmp_path: Path
) -> None:
    """The dashboard's demo under the default run root, as a new user starts it; then the README's export line."""
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "SPECDEC_TUI_CONFIG_DIR": str(tmp_path / "config")}
    r = cli("launch", "local", "--wait", "first-step", "--timeout", "150", "--json", env=env, timeout_s=180)
    try:
        assert r.returncode == 0, r.output
    finally:
        stop = cli("stop", "local", "--grace", "60", env=env, timeout_s=90)
    assert stop.returncode == 0, stop.output
    output_dir = str(home / ".specdec" / "engine" / "runs" / "cpu-demo")
    status = cli("status", "local", "--json", env=env)
    assert json.loads(status.stdout)["run"]["output_dir"] == output_dir, status.output
    assert f"output  {output_dir}" in cli("status", "local", env=env).stdout
    assert output_dir in cli("runs", "local", env=env).stdout
    # The README's line as written, with its destination in this test's directory.
    assert README_EXPORT in (REPO / "README.md").read_text(encoding="utf-8")
    command = README_EXPORT.replace("/tmp/cpu-demo-drafters", str(tmp_path / "cpu-demo-drafters"))
    bin_dir = str(Path(sys.executable).parent)
    done = subprocess.run(
        ["sh", "-c", command],
        env={**os.environ, **env, "PATH": bin_dir + os.pathsep + os.environ["PATH"], "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in (tmp_path / "cpu-demo-drafters").iterdir()) == ["drafter0", "drafter1"]


def test_restart_relaunches_the_recorded_command(cli: Cli, run_root: Path) -> None:
    r = cli("launch", "local", "--run-root", str(run_root), "--wait", "started", "--json", "--", "sleep", "300")
    assert r.returncode == 0, r.output
    first = json.loads(r.stdout)["run_id"]
    try:
        r = cli("restart", "local", "--run-root", str(run_root), "--grace", "2", "--wait", "started", "--json")
        assert r.returncode == 0, r.output
        second = json.loads(r.stdout)["run_id"]
        assert second != first
        assert json.loads((run_root / "runs" / first / "exit.json").read_text())
    finally:
        cli("stop", "local", "--run-root", str(run_root), "--grace", "2")


def test_logs_tail_and_follow(cli: Cli, run_root: Path) -> None:
    code = "import time\nfor i in range(30):\n    print(f'n={i}', flush=True)\n    time.sleep(0.02)\ntime.sleep(30)\n"
    r = cli("launch", "local", "--run-root", str(run_root), "--wait", "output", "--", sys.executable, "-c", code)
    assert r.returncode == 0, r.output
    try:
        log = next((run_root / "runs").iterdir()) / "output.log"
        wait_until(lambda: log.read_text().count("\n") >= 30, 10, "30 lines in output.log")
        tail = cli("logs", "local", "--run-root", str(run_root), "-n", "3")
        assert tail.returncode == 0 and tail.stdout == "n=27\nn=28\nn=29\n", tail.output
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        follow = subprocess.Popen(
            [sys.executable, "-m", "tui", "logs", "local", "--run-root", str(run_root), "-n", "2", "-f"],
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert follow.stdout is not None
            assert follow.stdout.readline() == b"n=28\n" and follow.stdout.readline() == b"n=29\n"
            with log.open("ab") as f:  # bytes appended to the file appear on the follower, exactly once
                f.write(b"appended \xff bytes\n")
            assert follow.stdout.readline() == b"appended \xff bytes\n"
        finally:
            follow.terminate()
            follow.wait(10)
    finally:
        cli("stop", "local", "--run-root", str(run_root), "--grace", "2")


def test_kill_stale_dry_run_json(cli: Cli, run_root: Path) -> None:
    r = cli("kill-stale", "local", "--run-root", str(run_root), "--dry-run", "--json")
    assert r.returncode == 0, r.output
    obj = json.loads(r.stdout)
    assert obj["dry_run"] is True and isinstance(obj["candidates"], list) and obj["signalled"] == []


def test_doctor_prints_each_check_with_a_verdict(cli: Cli, run_root: Path) -> None:
    r = cli("doctor", "local", "--run-root", str(run_root))
    assert r.returncode in (0, 1), r.output
    lines = [ln for ln in r.stdout.splitlines() if ln[:4] in ("PASS", "FAIL", "WARN")]
    names = {ln.split()[1] for ln in lines}
    assert {"connection", "python", "tmux", "disk"} <= names
    assert (r.returncode == 0) == (not any(ln.startswith("FAIL") for ln in lines))
    assert all("fix:" in r.stdout.split(ln, 1)[1].splitlines()[1] for ln in lines if ln.startswith("FAIL"))


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a machine with an NVIDIA driver has CUDA to check")
def test_doctor_on_a_cpu_box_says_not_present_and_passes_unless_a_gpu_is_expected(
    cli: Cli, run_root: Path, tmp_path: Path
) -> None:
    r = cli("doctor", "local", "--run-root", str(run_root), timeout_s=120)
    by = {ln.split()[1]: ln for ln in r.stdout.splitlines() if ln[:4] in ("PASS", "FAIL", "WARN")}
    assert r.returncode == 0, r.output
    assert by["cuda"].startswith("PASS") and "not present" in by["cuda"], r.stdout
    assert by["nvml"].startswith("PASS") and "not present" in by["nvml"], r.stdout
    expected = cli("doctor", "local", "--run-root", str(run_root), "--expect-gpu", timeout_s=120)
    assert expected.returncode == 1, expected.output
    failed = {ln.split()[1] for ln in expected.stdout.splitlines() if ln.startswith("FAIL")}
    assert {"cuda", "nvml"} <= failed, expected.stdout
    config = tmp_path / "config.toml"
    config.write_text('[profiles.gpu]\ncommand = ["python3", "train.py"]\nenv = { CUDA_VISIBLE_DEVICES = "0" }\n')
    profiled = cli("doctor", "local", "--run-root", str(run_root), "--config", str(config), "--profile", "gpu")
    assert profiled.returncode == 1 and "FAIL  cuda" in profiled.stdout, profiled.output


def test_bundle_is_reproducible_has_no_tests_and_runs_as_a_zipapp(tmp_path: Path) -> None:
    one, two = ship.build_bundle_bytes(), ship.build_bundle_bytes()
    assert one == two
    path = ship.write_bundle(tmp_path)
    assert path.name == f"{ship.protocol.AGENT_VERSION}-{hashlib.sha256(path.read_bytes()).hexdigest()[:16]}.pyz"
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
    rooms = {f"engine/protocol/{room.name}" for room in (REPO / "engine" / "protocol").glob("*.py")}
    assert "__main__.py" in names and "engine/agent/main.py" in names
    assert "engine/protocol/__init__.py" in rooms and rooms <= set(names)  # every room of the protocol goes
    assert "engine/supervisor/wrapper.py" in names and "engine/trainer/__main__.py" in names
    assert not [n for n in names if "/tests/" in n or n.startswith("tests/") or "__pycache__" in n]
    hello = subprocess.run(
        [sys.executable, str(path), "--run-root", str(tmp_path / "root"), "--simulate-gpus", "1"],
        input=b"",
        capture_output=True,
        timeout=60,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)},
    )
    first = json.loads(hello.stdout.splitlines()[0])
    assert first["ev"] == "hello" and first["simulated"] is True, hello.stderr


def test_target_parsing_and_quoting() -> None:
    assert Target.parse("local").local
    assert Target.parse("root@gpu-box:2222") == Target(local=False, host="gpu-box", user="root", port=2222)
    assert Target.parse("gpu-box") == Target(local=False, host="gpu-box")
    assert Target.parse("me@[::1]:22") == Target(local=False, host="::1", user="me", port=22)
    for bad in ("", "-oProxyCommand=x", "a b", "user@", "host:port"):
        with pytest.raises(ValueError):
            Target.parse(bad)
    argv = pct_wrap(["python3", "-c", "print('a b')", "$(x)"], 200)
    assert argv[:4] == ["pct", "exec", "200", "--"]
    assert remote_command(argv) == "pct exec 200 -- python3 -c 'print('\"'\"'a b'\"'\"')' '$(x)'"
    with pytest.raises(ValueError):
        pct_wrap(["true"], "200; reboot")  # type: ignore[arg-type]


def test_backoff_is_capped_exponential_with_jitter() -> None:
    s = Session(LocalTransport(Target(local=True), ConnectOptions()), ConnectOptions())
    s.backoff_base_s, s.backoff_cap_s = 0.5, 8.0
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (4, 4.0), (5, 8.0), (12, 8.0)]:
        values = {s.backoff_s(attempt) for _ in range(20)}
        assert all(ceiling / 2 <= v <= ceiling for v in values) and len(values) > 1


async def test_session_request_reply_ping_and_reconnect_after_the_agent_dies(run_root: Path) -> None:
    import asyncio

    opts = ConnectOptions(run_root=str(run_root), simulate_gpus=1)
    session = Session(LocalTransport(Target(local=True), opts), opts)
    session.backoff_base_s = 0.05
    events: list[ClientEvent] = []
    session.add_event_listener(events.append)
    await session.connect()
    try:
        assert session.state == "connected" and session.agent is not None
        assert await session.ping() > 0 and session.rtt_ms is not None
        results = await asyncio.gather(*(session.request("ping", timeout_s=10) for _ in range(20)))
        assert len({r["t"] for r in results}) >= 1 and all("agent_pid" in r for r in results)
        old_pid = session.agent.pid
        assert old_pid is not None
        os.kill(old_pid, 9)
        await wait_until_async(
            lambda: session.state == "connected" and session.agent is not None and session.agent.pid != old_pid,
            10,
            "a reconnect to a new agent",
            observe=lambda: session.state,
        )
        states = [e.state for e in events if isinstance(e, ConnectionEvent)]
        assert states[:2] == ["connecting", "connected"] and "reconnecting" in states and states[-1] == "connected"
        assert (await session.request("status", timeout_s=30))["gpus"]
    finally:
        await session.close()
    assert session.state == "disconnected"


@pytest.mark.parametrize(
    "argv",
    [
        ["launch", "local", "--run", "20261201-101500-ab12"],  # was read as --run-root 20261201-...
        ["kill-stale", "local", "--dry-run", "--run", "20261201-101500-ab12"],
        ["stop", "local", "--run-r", "/tmp/elsewhere"],
        ["restart", "local", "--grac", "3"],
        ["status", "local", "--js"],
        ["logs", "local", "--fol"],
    ],
    ids=lambda a: " ".join(a[:1] + a[2:]),
)
def test_no_option_is_read_by_a_prefix_of_its_name(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from tui.__main__ import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    assert f"unrecognized arguments: {argv[-2] if argv[-1][0] != '-' else argv[-1]}" in capsys.readouterr().err


def _job_pid(run_root: Path, run_id: str) -> int:
    launch = json.loads((run_root / "runs" / run_id / "launch.json").read_text())
    return int(launch.get("job_pid") or launch["pid"])


def test_stop_and_restart_with_run_act_on_that_run_and_leave_the_current_one(cli: Cli, run_root: Path) -> None:
    from engine.host import procs

    ids = []
    for _ in range(2):
        r = cli("launch", "local", "--run-root", str(run_root), "--wait", "started", "--json", "--", "sleep", "300")
        assert r.returncode == 0, r.output
        ids.append(json.loads(r.stdout)["run_id"])
    older, current = ids
    try:
        stop = cli("stop", "local", "--run-root", str(run_root), "--run", older, "--grace", "2")
        assert stop.returncode == 0, stop.output
        assert f"run {older} stopped" in stop.stdout, stop.output
        assert json.loads((run_root / "runs" / older / "exit.json").read_text())
        assert procs.process_alive(_job_pid(run_root, current), None), "the current run was stopped"

        again = cli("restart", "local", "--run-root", str(run_root), "--run", older, "--wait", "started", "--json")
        assert again.returncode == 0, again.output
        relaunched = json.loads(again.stdout)["run_id"]
        assert relaunched not in ids
        assert json.loads((run_root / "runs" / relaunched / "launch.json").read_text())["command"] == ["sleep", "300"]
        assert procs.process_alive(_job_pid(run_root, current), None), "the restart stopped the current run"
        assert not (run_root / "runs" / current / "exit.json").exists()

        unknown = cli("stop", "local", "--run-root", str(run_root), "--run", "20200101-000000-0000")
        assert unknown.returncode == 2 and "Traceback" not in unknown.output, unknown.output
        assert unknown.stderr.strip().splitlines()[-1].startswith("specdec-tui stop: error: --run 20200101-000000-0000")
    finally:
        for run_id in [*ids, *([relaunched] if "relaunched" in locals() else [])]:
            cli("stop", "local", "--run-root", str(run_root), "--run", run_id, "--grace", "2")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("[profiles.demo]\ndeadlines_s = { started = " + "9" * 5000 + " }\n", "a value too large to read"),
        ("[profiles.demo]\nenv = " + "[" * 5000 + "]" * 5000 + "\n", "nested too deep to read"),
        ("[profiles.demo]\ndeadlines_s = { started = -" + "9" * 4000 + " }\n", "positive number of seconds, got -99"),
    ],
    ids=["5000-digit integer", "nested 5000 deep", "4000-digit value in a message"],
)
def test_a_hostile_config_file_is_one_line_and_exit_2(cli: Cli, tmp_path: Path, body: str, words: str) -> None:
    cfg = tmp_path / "config.toml"
    cfg.write_text(body)
    r = cli("launch", "local", "--config", str(cfg), "--profile", "demo", "--run-root", str(tmp_path / "root"))
    assert r.returncode == 2, r.output
    assert "Traceback" not in r.output and r.stdout == "", r.output
    said = r.stderr.strip().splitlines()[-1]
    assert said.startswith(f"specdec-tui launch: error: {cfg}: ") and words in said and len(said) < 400, said


def test_a_config_file_that_is_a_fifo_is_refused_at_once(cli: Cli, tmp_path: Path) -> None:
    cfg = tmp_path / "config.toml"
    os.mkfifo(cfg)
    r = cli("launch", "local", "--config", str(cfg), "--profile", "demo", "--run-root", str(tmp_path), timeout_s=20)
    assert r.returncode == 2, r.output
    assert "not a regular file" in r.stderr and "Traceback" not in r.output, r.output
