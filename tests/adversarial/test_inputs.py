"""Malformed run profiles (tui/profiles.py) and engine configs (engine/trainer/config.py): every error names
the file, the key and what is allowed, and none is a crash."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.trainer.config import ConfigError, load_toml
from tui.profiles import ProfileError, resolve_profile

REPO_ROOT = Path(__file__).resolve().parents[2]

# (TOML text, key the message must name, a fragment of what is allowed)
BAD_PROFILES: list[tuple[str, str, str]] = [
    ("profiles = [", "TOML", "TOML"),
    ("colour = 1", "colour", "allowed: default_profile"),
    ("profiles = 3", "profiles", "[profiles.NAME]"),
    ('[profiles."bad name!"]\ncwd = "/x"', "profiles.bad name!", "letters, digits"),
    ('[profiles.a]\ncommand = "bash run.sh"', "profiles.a.command", "list of strings"),
    ("[profiles.a]\ncommand = []", "profiles.a.command", "must not be empty"),
    ("[profiles.a]\ncommand = [1, 2]", "profiles.a.command", "list of strings"),
    ("[profiles.a]\ncwd = 5", "profiles.a.cwd", "non-empty string"),
    ('[profiles.a]\ncwd = ""', "profiles.a.cwd", "non-empty string"),
    ("[profiles.a]\nenv = { A = 1 }", "profiles.a.env", "string values"),
    ('[profiles.a]\nenv = { "1BAD" = "x" }', "profiles.a.env.1BAD", "[A-Za-z_]"),
    ('[profiles.a]\nenv = "A=1"', "profiles.a.env", "table of string values"),
    ('[profiles.a]\nstep_pattern = "("', "profiles.a.step_pattern", "regular expression"),
    ("[profiles.a]\nstep_pattern = 5", "profiles.a.step_pattern", "regular expression"),
    ("[profiles.a]\ndeadlines_s = { started = -1 }", "profiles.a.deadlines_s.started", "positive number"),
    ('[profiles.a]\ndeadlines_s = { started = "10" }', "profiles.a.deadlines_s.started", "positive number"),
    ("[profiles.a]\ndeadlines_s = { started = true }", "profiles.a.deadlines_s.started", "positive number"),
    ("[profiles.a]\ndeadlines_s = { soon = 5 }", "profiles.a.deadlines_s.soon", "submitted, started, output"),
    ("[profiles.a]\ndeadlines_s = 5", "profiles.a.deadlines_s", "submitted, started, output"),
    ("[profiles.a]\nengine = 5", "profiles.a.engine", "args, config, preset"),
    ('[profiles.a]\nengine = { preset = "" }', "profiles.a.engine.preset", "non-empty string"),
    ("[profiles.a]\nengine = { bogus = 1 }", "profiles.a.engine.bogus", "args, config, preset"),
    ('[profiles.a]\nengine = { preset = "a", config = "b" }', "profiles.a.engine", "either preset or config"),
    ('[profiles.a]\nengine = { args = "x" }', "profiles.a.engine.args", "list of strings"),
    ("[profiles.a]\nfoo = 1", "profiles.a.foo", "allowed: command, cwd"),
    ('default_profile = "missing"', "default_profile", "defined: default"),
    ("default_profile = 3", "default_profile", "defined: default"),
]


@pytest.mark.parametrize("text,key,allowed", BAD_PROFILES, ids=[f"p{i}" for i in range(len(BAD_PROFILES))])
def test_malformed_profile_names_the_file_the_key_and_what_is_allowed(
    tmp_path: Path, text: str, key: str, allowed: str
) -> None:
    path = tmp_path / "my profiles.toml"
    path.write_text(text + "\n")
    with pytest.raises(ProfileError) as err:
        resolve_profile("a", str(path))
    msg = str(err.value)
    assert str(path) in msg and key in msg and allowed in msg, msg


def test_unreadable_profile_files_are_errors_not_crashes(tmp_path: Path) -> None:
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe[profiles.a]\x00\n")
    missing = tmp_path / "missing.toml"
    for path, fragment in ((binary, "not valid TOML"), (tmp_path, "cannot read"), (missing, "no such config file")):
        with pytest.raises(ProfileError) as err:
            resolve_profile(None, str(path))
        assert str(path) in str(err.value) and fragment in str(err.value), str(err.value)
    ok = tmp_path / "ok.toml"
    ok.write_text('[profiles.a]\ncommand = ["true"]\n')
    with pytest.raises(ProfileError) as err:
        resolve_profile("b", str(ok))
    assert str(ok) in str(err.value) and "profiles.b" in str(err.value) and "defined: a, default" in str(err.value)


def test_the_cli_reports_a_malformed_profile_with_exit_2_and_no_traceback(
    cli: Callable[..., Any], tmp_path: Path
) -> None:
    path = tmp_path / "p.toml"
    path.write_text("[profiles.a]\ndeadlines_s = { soon = 5 }\n")
    r = cli("launch", "local", "--config", str(path), "--profile", "a", "--run-root", str(tmp_path / "root"))
    assert r.returncode == 2, r.output
    assert str(path) in r.stderr and "profiles.a.deadlines_s.soon" in r.stderr and "Traceback" not in r.output


# (TOML text, key the message must name, a fragment of what is allowed)
BAD_ENGINE_CONFIGS: list[tuple[str, str, str]] = [
    ("stepz = 10", "stepz", "known keys"),
    ('steps = "ten"', "steps", "integer"),
    ("steps = 0", "steps", ">= 1"),
    ("steps = 1.5", "steps", "integer"),
    ('drafter_mode = "solo"', "drafter_mode", "replicas, independent"),
    ('drafter_devices = ["tpu:0"]', "drafter_devices", "'cuda:N'"),
    ("drafter_devices = []", "drafter_devices", "non-empty list"),
    ('drafter_devices = "cpu"', "drafter_devices", "non-empty list"),
    ("buckets = [64, 32]", "buckets", "increasing"),
    ("buckets = [8]", "buckets", ">= 16"),
    ("compile = 1", "compile", "true or false"),
    ("target_layers = [1, 2]", "target_layers", "three"),
    ('schedule = "exp"', "schedule", "constant, cosine, linear"),
    ('target = "/no/such/model"', "target", "built-in preset"),
    ('preset = "gpu-max"', "preset", "cpu-demo"),
    ("lr = -1.0", "lr", "positive"),
]
# Values whose type the config does not check before comparing: they crash instead of naming the key.
CRASHING_ENGINE_CONFIGS: list[tuple[str, str, str]] = [
    ('lr = "fast"', "lr", "number"),
    ("buckets = 5", "buckets", "list"),
    ('heartbeat_interval_s = "1s"', "heartbeat_interval_s", "seconds"),
]


@pytest.mark.parametrize("text,key,allowed", BAD_ENGINE_CONFIGS, ids=[f"e{i}" for i in range(len(BAD_ENGINE_CONFIGS))])
def test_malformed_engine_config_names_the_key_and_what_is_allowed(
    tmp_path: Path, text: str, key: str, allowed: str
) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_toml(path)
    msg = str(err.value)
    assert key in msg and allowed in msg, msg


def test_malformed_engine_config_errors_name_the_file(tmp_path: Path) -> None:
    unnamed = []
    for i, (text, _key, _allowed) in enumerate(BAD_ENGINE_CONFIGS):
        path = tmp_path / f"engine-{i}.toml"
        path.write_text(text + "\n")
        with pytest.raises(ConfigError) as err:
            load_toml(path)
        if str(path) not in str(err.value):
            unnamed.append(f"{text!r}: {err.value}")
    assert not unnamed, unnamed


@pytest.mark.parametrize(
    "text,key,allowed", CRASHING_ENGINE_CONFIGS, ids=[f"c{i}" for i in range(len(CRASHING_ENGINE_CONFIGS))]
)
def test_engine_config_of_the_wrong_type_is_an_error_not_a_crash(
    tmp_path: Path, text: str, key: str, allowed: str
) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(text + "\n")
    with pytest.raises(ConfigError) as err:
        load_toml(path)
    assert key in str(err.value) and allowed in str(err.value)


def test_unreadable_engine_config_files_are_errors_not_crashes(tmp_path: Path) -> None:
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfesteps = 1\n")
    for path in (binary, tmp_path):
        with pytest.raises(ConfigError) as err:
            load_toml(path)
        assert str(path) in str(err.value)


def test_the_trainer_cli_reports_a_bad_config_with_exit_2_before_importing_torch(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('drafter_mode = "solo"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "engine.trainer", "--config", str(path)],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "drafter_mode" in done.stderr and "replicas, independent" in done.stderr
    assert "Traceback" not in done.stderr


def test_runs_limit_over_the_hosts_cap_is_a_usage_error(cli: Callable[..., Any], run_root: Path) -> None:
    r = cli("runs", "local", "--run-root", str(run_root), "--limit", "2000")
    assert r.returncode == 2 and "expected 1..500 runs, got 2000" in r.output, r.output
    assert not any(run_root.iterdir())  # refused before any agent ran


def test_a_current_link_out_of_the_runs_directory_is_refused_with_its_reason(
    cli: Callable[..., Any], run_root: Path
) -> None:
    (run_root / "runs").mkdir()
    (run_root / "current").symlink_to("/etc")
    r = cli("logs", "local", "--run-root", str(run_root), "--python", sys.executable)
    assert r.returncode == 1, r.output
    assert f"{run_root / 'current'} points outside {run_root / 'runs'} (to /etc); refused" in r.output, r.output
    status = cli("status", "local", "--run-root", str(run_root), "--python", sys.executable, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["run"] is None, status.output
