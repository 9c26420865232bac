"""The restart policy's pieces without processes: parsing (profile and wire), classifying an ending, OOM lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import protocol
from engine.host.appended import AppendedFile
from engine.supervisor import launch, restart
from engine.supervisor.common import SupervisorError
from engine.supervisor.restart import complete_lines
from tui.profiles import ProfileError, load_profiles


def profile_with(tmp_path: Path, restart_toml: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[profiles.big]\ncommand = ["bash", "train.sh"]\nrestart = {restart_toml}\n')
    return path


def test_a_profile_restart_table_becomes_the_launch_specs_policy(tmp_path: Path) -> None:
    path = profile_with(tmp_path, '{ on = ["oom", "crash", "hang"], max = 3, backoff_s = 30 }')
    profiles, _, _ = load_profiles(str(path))
    spec = profiles["big"].launch_spec(None, python="python3", engine_pythonpath=None)
    assert spec.restart == {
        "on": ["crash", "hang", "oom"],
        "max": 3,
        "backoff_s": 30.0,
        "stall_s": 1800.0,
        "grace_s": 30.0,
    }
    assert profiles["big"].as_dict()["restart"] == spec.restart


def test_a_profile_without_restart_is_never_restarted(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[profiles.big]\ncommand = ["bash", "train.sh"]\n')
    profiles, _, _ = load_profiles(str(path))
    assert profiles["big"].launch_spec(None, python="python3", engine_pythonpath=None).restart is None


@pytest.mark.parametrize(
    ("table", "key", "problem"),
    [
        ('{ on = ["reboot"] }', "profiles.big.restart.on", "unknown cause 'reboot'; allowed: crash, hang, oom"),
        ('{ on = "crash" }', "profiles.big.restart.on", "must be a list of causes among crash, hang, oom"),
        ("{ max = -1 }", "profiles.big.restart.max", "must not be negative, got -1"),
        ("{ max = 2.5 }", "profiles.big.restart.max", "must be a whole number of restarts, got 2.5"),
        ("{ max = true }", "profiles.big.restart.max", "must be a whole number of restarts, got True"),
        ('{ backoff_s = "30" }', "profiles.big.restart.backoff_s", "must be a number of seconds, got '30'"),
        ("{ backoff_s = -1 }", "profiles.big.restart.backoff_s", "must not be negative, got -1"),
        ("{ stall_s = 0 }", "profiles.big.restart.stall_s", "must be a positive number of seconds, got 0"),
        ("{ tries = 3 }", "profiles.big.restart.tries", "unknown key; allowed: on, max, backoff_s, stall_s, grace_s"),
        ("3", "profiles.big.restart", "must be a table such as"),
    ],
)
def test_bad_restart_input_is_a_config_error_naming_the_key(tmp_path: Path, table: str, key: str, problem: str) -> None:
    path = profile_with(tmp_path, table)
    with pytest.raises(ProfileError) as err:
        load_profiles(str(path))
    assert str(err.value).startswith(f"{path}: {key}: {problem}")


def test_the_agent_refuses_a_bad_policy_on_the_wire_naming_the_key() -> None:
    with pytest.raises(SupervisorError, match=r"^launch field restart\.max: must not be negative, got -2$"):
        launch.coerce_spec({"command": ["true"], "restart": {"max": -2}})
    spec = launch.coerce_spec({"command": ["true"], "restart": {"on": ["hang"], "stall_s": 5}})
    assert spec.restart is not None and spec.restart["on"] == ["hang"] and spec.restart["stall_s"] == 5.0


def test_which_endings_the_policy_restarts() -> None:
    every = protocol.parse_policy({"on": ["crash", "hang", "oom"]})
    crash_only = protocol.parse_policy({"on": ["crash"]})
    failed = restart.Ending(1, None, "exited with code 1")
    killed = restart.Ending(None, 9, "killed by signal 9 (SIGKILL)")
    oom = restart.Ending(1, None, "exited with code 1", oom="torch.OutOfMemoryError: CUDA out of memory.")
    hung_then_clean = restart.Ending(0, None, "exited with code 0", hang="no step for 61.0 s (stall_s 60)")
    assert restart.restart_cause(restart.Ending(0, None, "exited with code 0"), every) is None
    assert restart.restart_cause(failed, every) == "crash"
    assert restart.restart_cause(killed, every) == "crash"
    assert restart.restart_cause(oom, every) == "oom"
    assert restart.restart_cause(oom, crash_only) == "crash"  # an OOM is a crash when only crashes are restarted
    assert restart.restart_cause(hung_then_clean, every) == "hang"  # our engine exits 0 on SIGTERM: still a hang
    assert restart.restart_cause(hung_then_clean, crash_only) is None
    assert restart.restart_cause(oom, protocol.parse_policy({"on": []})) is None


def test_only_this_attempts_output_can_mark_an_oom(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    start = log.stat().st_size
    with log.open("ab") as fh:
        fh.write(b"attempt 2\nValueError: bad batch\n")
    assert restart.find_oom(log, start) is None
    assert restart.find_oom(log, 0) == "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    with log.open("ab") as fh:
        fh.write(b"RuntimeError: CUDA out of memory. Tried to allocate 1 GiB\r\n")
    assert restart.find_oom(log, start) == "RuntimeError: CUDA out of memory. Tried to allocate 1 GiB"


def test_expandable_segments_join_the_users_allocator_settings() -> None:
    env, said = restart.with_expandable_segments({})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and "added" in said
    env, _ = restart.with_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"
    env, said = restart.with_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False" and "left as it is" in said


def test_a_hang_is_no_step_for_stall_s_and_loading_gets_the_first_step_deadline(tmp_path: Path) -> None:
    log, events = tmp_path / "output.log", tmp_path / "events.jsonl"
    log.write_text("old attempt step=5\n")
    watch = restart.ProgressWatch(log, events, r"step=\d+", 1000.0, stall_s=10.0, first_step_deadline_s=60.0)
    watch.poll(1001.0)
    assert watch.last_step_seen_at is None  # what an earlier attempt wrote is not this attempt's progress
    assert watch.hung(1059.0) is None  # loading: the first-step deadline (60 s) bounds it, not stall_s
    assert watch.hung(1061.0) == "no step 61.0 s after the attempt started (bound 60 s)"
    events.write_text('{"t": 1070.0, "kind": "step", "step": 1}\n')
    watch.poll(1070.0)
    assert watch.hung(1080.0) is None
    assert watch.hung(1080.5) == "no step for 10.5 s (stall_s 10)"
    with log.open("a") as fh:
        fh.write("step=2 loss=1.0\n")
    watch.poll(1081.0)
    assert watch.hung(1090.0) is None


def test_the_dashboards_launch_carries_the_profiles_restart_policy(tmp_path: Path) -> None:
    from tui.link.transport import ConnectOptions
    from tui.relaunch import launch_spec

    path = tmp_path / "config.toml"
    path.write_text(
        '[profiles.demo]\nrestart = { on = ["oom"], max = 1 }\n[profiles.demo.engine]\npreset = "cpu-demo"\n'
    )
    profiles, _, _ = load_profiles(str(path))

    class Unconnected:
        """A session before its first hello, shipped nowhere: the launch falls back to python3 on PATH."""

        agent = None
        opts = ConnectOptions()
        engine_pythonpath = None

    spec = protocol.to_jsonable(launch_spec(profiles["demo"], Unconnected()))  # type: ignore[arg-type]
    assert spec["command"][:3] == ["python3", "-m", "engine.trainer"]
    assert spec["restart"] == {"on": ["oom"], "max": 1, "backoff_s": 30.0, "stall_s": 1800.0, "grace_s": 30.0}
    assert launch.coerce_spec(spec).restart == spec["restart"]


def test_progress_reads_complete_lines_once_and_starts_over_on_a_replaced_file(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"old output\n")
    appended = AppendedFile(log, offset=log.stat().st_size)  # an attempt watches what comes after its start
    with log.open("ab") as fh:
        fh.write(b"step=1\rstep=2\rste")  # a progress bar's redraws end with \r; the last one is unfinished
    assert complete_lines(appended) == b"step=1\rstep=2\r"
    with log.open("ab") as fh:
        fh.write(b"p=3\n")
    assert complete_lines(appended) == b"step=3\n" and complete_lines(appended) == b""
    log.write_bytes(b"new\n")  # truncated (a new attempt's file): read from its start
    assert complete_lines(appended) == b"new\n"
