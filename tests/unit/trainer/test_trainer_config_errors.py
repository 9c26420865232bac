"""Engine config errors: every wrong value is a ConfigError naming the key and the allowed type (never a
TypeError out of validate()), and every error about a file starts with that file's path."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.imports import imported_by, specdec_train

from engine.trainer.config import PRESETS, ConfigError, TrainerConfig, from_dict, load_toml, preset

REPO_ROOT = Path(__file__).resolve().parents[3]

# (key, wrong value, the message after "key: ")
WRONG_TYPES: list[tuple[str, Any, str]] = [
    ("lr", "fast", 'expected a number, got "fast" (str)'),
    ("lr", True, "expected a number, got true (bool)"),
    ("lr", [1.0], "expected a number, got [1.0] (list)"),
    ("weight_decay", math.nan, "expected a number, got NaN (float)"),
    ("heartbeat_interval_s", "1s", 'expected a number of seconds, got "1s" (str)'),
    ("stall_after_s", {"a": 1}, 'expected a number of seconds, got {"a": 1} (dict)'),
    ("steps", "ten", 'expected an integer, got "ten" (str)'),
    ("steps", 1.5, "expected an integer, got 1.5 (float)"),
    ("steps", True, "expected an integer, got true (bool)"),
    ("compile", 1, "expected true or false, got 1 (int)"),
    ("compile", "yes", 'expected true or false, got "yes" (str)'),
    ("target", 3, "expected a string, got 3 (int)"),
    ("buckets", 5, "expected a list of integers, got 5 (int)"),
    ("buckets", [16, True], "expected a list of integers, got [16, true] (list)"),
    ("buckets", [16.0, 32.0], "expected a list of integers, got [16.0, 32.0] (list)"),
    ("drafter_devices", "cpu", "expected a non-empty list of devices, e.g. ['cuda:0'], got \"cpu\" (str)"),
    ("target_devices", [0], "expected a non-empty list of devices, e.g. ['cuda:0'], got [0] (list)"),
    ("target_layers", 2, "expected a list of three integers (low, middle, high), got 2 (int)"),
    ("drafter_lrs", ["1e-3"], 'expected a list of numbers, one learning rate per drafter, got ["1e-3"] (list)'),
    ("output_dir", None, "expected a string, got null (NoneType)"),
]


@pytest.mark.parametrize("key,value,message", WRONG_TYPES, ids=[f"{k}={v!r}" for k, v, _ in WRONG_TYPES])
def test_a_value_of_the_wrong_type_names_the_key_the_type_and_the_value(key: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict({key: value})
    assert str(err.value) == f"{key}: {message}"


def test_ints_are_numbers_and_optional_lists_may_be_unset() -> None:
    cfg = from_dict({"lr": 1, "heartbeat_interval_s": 2, "drafter_mode": "independent"})
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and isinstance(cfg.heartbeat_interval_s, float)
    cfg = from_dict({"drafter_lrs": [1, 0.5]}, TrainerConfig(drafter_mode="independent", drafter_devices=["cpu"] * 2))
    assert cfg.drafter_lrs == [1.0, 0.5] and all(isinstance(x, float) for x in cfg.drafter_lrs)
    assert from_dict({"target_layers": None, "drafter_lrs": None}).target_layers is None


def test_every_field_type_is_understood_and_every_preset_round_trips() -> None:
    defaults = TrainerConfig()
    for f in dataclasses.fields(TrainerConfig):  # a new field of a type the checker does not know fails here
        assert getattr(from_dict({f.name: getattr(defaults, f.name)}), f.name) == getattr(defaults, f.name)
    for name in PRESETS:
        cfg = preset(name)
        assert from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("max_grad_norm", 0, "max_grad_norm: a positive number"),
        ("weight_decay", -0.1, "weight_decay: a number >= 0"),
        ("stall_after_s", 0, "stall_after_s: a positive number of seconds"),
        ("stop_grace_s", -1, "stop_grace_s: a positive number of seconds"),
        ("torch_threads", -1, "torch_threads: an integer >= 0"),
        ("flex_bwd_num_stages", -1, "flex_bwd_num_stages: an integer from 0"),
        ("flex_bwd_num_stages", 9, "flex_bwd_num_stages: an integer from 0"),
    ],
)
def test_numbers_that_were_not_range_checked_are_now(key: str, value: Any, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        from_dict({key: value})


# (file bytes, what the message must hold after "<path>: ")
BAD_FILES: list[tuple[bytes, str]] = [
    (b'lr = "fast"\n', 'lr: expected a number, got "fast" (str)'),
    (b"[engine]\nbuckets = 5\n", "buckets: expected a list of integers, got 5 (int)"),
    (b"stepz = 1\n", "stepz: unknown key; known keys: "),
    (b'drafter_mode = "solo"\n', "drafter_mode: got 'solo'; allowed: replicas, independent"),
    (b'preset = "gpu-max"\n', "preset: got 'gpu-max'; allowed: cpu-demo, h200-single"),
    (b"preset = 5\n", "preset: expected a string, got 5 (int); allowed: cpu-demo, h200-single"),
    (b'preset = "cpu-demo"\nsteps = 0\n', "steps: an integer >= 1"),
    (b"steps = 1\nlr = = 2\n", "not valid TOML: Invalid value (at line 2, column 6)"),
    (b"steps = 1\n\xff\xfe\n", "not valid TOML: not UTF-8 text (byte 10, line 2)"),
]


@pytest.mark.parametrize("content,message", BAD_FILES, ids=[f"f{i}" for i in range(len(BAD_FILES))])
def test_every_error_about_a_file_starts_with_its_path(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "my engine.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_toml(path)
    assert str(err.value).startswith(f"{path}: {message}"), str(err.value)


def test_a_missing_file_or_a_directory_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file") as err:
        load_toml(tmp_path / "missing.toml")
    assert str(err.value) == f"{tmp_path / 'missing.toml'}: no such config file"
    with pytest.raises(ConfigError) as err:
        load_toml(tmp_path)
    assert str(err.value).startswith(f"{tmp_path}: cannot read: ")


def test_a_good_file_loads_with_its_preset_and_engine_table(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('preset = "cpu-demo"\n[engine]\nsteps = 7\nlr = 1\n')
    cfg = load_toml(path)
    assert cfg.steps == 7 and cfg.lr == 1.0 and cfg.drafter_lrs == PRESETS["cpu-demo"]["drafter_lrs"]


def _train(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("SPECDEC_RUN_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "engine.trainer", *args],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=60, check=False,
    )  # fmt: skip


def test_the_cli_prints_file_key_and_type_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text('lr = "fast"\n')
    done = _train("--config", str(path))
    assert done.returncode == 2, done.stderr
    assert done.stderr == f'specdec-train: config error: {path}: lr: expected a number, got "fast" (str)\n'
    done = _train("--preset", "cpu-demo", "--set", "buckets=5", "--print-config")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == "specdec-train: config error: buckets: expected a list of integers, got 5 (int)\n"


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="this machine has CUDA: the check has nothing to say")
def test_cuda_devices_on_a_machine_without_cuda_exit_2_before_torch_loads_without_a_traceback(tmp_path: Path) -> None:
    done = imported_by(
        specdec_train(
            "--preset", "cpu-demo", "--set", 'target_devices=["cuda:0"]',
            "--set", 'drafter_devices=["cuda:0", "cuda:1"]', "--set", f"output_dir={tmp_path / 'out'}",
        )
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("specdec-train: config error: target_devices: names cuda:0, but this machine has")
    assert "no CUDA device" in done.stderr
    assert done.loaded == [], f"the check must come before torch loads; loaded: {done.loaded}"
    assert not (tmp_path / "out").exists()


def test_target_layers_out_of_ascending_order_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError) as err:
        from_dict({"target_layers": [4, 1, 3]})
    assert str(err.value).startswith("target_layers: [4, 1, 3] is not in ascending order")
    assert "write [1, 3, 4]" in str(err.value)
    assert from_dict({"target_layers": [1, 3, 4]}).target_layers == [1, 3, 4]
    done = _train("--preset", "cpu-demo", "--set", "target_layers=[4, 1, 3]", "--print-config")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("specdec-train: config error: target_layers: [4, 1, 3] is not in ascending order")


def test_strict_data_ends_the_run_with_exit_2_naming_file_and_line_without_a_traceback(tmp_path: Path) -> None:
    data = tmp_path / "chat.jsonl"
    good = json.dumps({"conversations": [{"from": "human", "value": "hi?"}, {"from": "gpt", "value": "hello."}]})
    data.write_text("\n".join([good] * 8 + ['{"conversations": [ oops'] + [good] * 8) + "\n", encoding="utf-8")
    done = _train(
        "--preset", "cpu-demo", "--set", f"data={data}", "--set", "strict_data=true", "--set", "eval_holdout=0",
        "--set", f"output_dir={tmp_path / 'out'}",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"specdec-train: config error: strict_data: {data}:9: not JSON: ")


@pytest.mark.parametrize(
    "values,fragment",
    [
        ({"lr": math.inf}, "lr: a finite positive number, got inf"),
        ({"lr": -math.inf}, "lr: a finite positive number, got -inf"),
        (
            {"drafter_mode": "independent", "drafter_lrs": [1e-3, math.inf], "drafter_devices": ["cpu", "cpu"]},
            "drafter_lrs: one positive learning rate per drafter device (2), each finite",
        ),
        ({"weight_decay": math.inf}, "weight_decay: a number >= 0, finite"),
        ({"lr": 10**400}, "lr: expected a number, got "),  # an integer no float holds
        ({"steps": 10**30}, "steps: 1000000000000000000000000000000 (int) is out of range"),
    ],
    ids=["lr-inf", "lr-minus-inf", "drafter-lrs-inf", "weight-decay-inf", "lr-huge-int", "steps-beyond-int64"],
)
def test_learning_rates_must_be_finite_and_integers_must_fit_64_bits(values: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(values)
    assert str(err.value).startswith(fragment), str(err.value)


@pytest.mark.parametrize("output_dir", ["/", "/etc", "/usr/", "/var/log", "/proc/self", "/sys/kernel", "~/../.."])
def test_an_output_dir_that_is_the_root_or_a_system_directory_is_refused(output_dir: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict({"output_dir": output_dir})
    assert str(err.value).startswith(f"output_dir: {output_dir!r} is "), str(err.value)
    assert "name a directory of its own" in str(err.value)


def test_an_output_dir_under_a_system_directory_or_relative_is_accepted(tmp_path: Path) -> None:
    for ok in (str(tmp_path / "run"), "runs/x", "/var/tmp/specdec-run", "/usr/local/share/runs/a"):
        assert from_dict({"output_dir": ok}).output_dir == ok


HUGE_INT = "9" * 5000
DEEP_ARRAY = "[" * 5000 + "]" * 5000


@pytest.mark.parametrize(
    "content,message",
    [
        (f"steps = {HUGE_INT}\n", "not valid TOML: an integer of more than 4300 digits"),
        (f"buckets = {DEEP_ARRAY}\n", "not valid TOML: arrays or tables nested too deeply"),
        ("a = " + "{b = " * 3000 + "1" + "}" * 3000 + "\n", "not valid TOML: arrays or tables nested too deeply"),
    ],
    ids=["5000-digit-integer", "deep-array", "deep-inline-table"],
)
def test_a_toml_file_the_parser_gives_up_on_is_a_config_error_naming_it(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        load_toml(path)
    assert str(err.value) == f"{path}: {message}"


@pytest.mark.parametrize(
    "args,line",
    [
        (["--set", f"steps={HUGE_INT}"], f"--set 'steps={'9' * 51}...': an integer of more than 4300 digits"),
        (["--set", f"buckets={DEEP_ARRAY}"], f"--set 'buckets={'[' * 49}...': arrays or tables nested too deeply"),
        (["--set", "lr=inf"], "lr: a finite positive number, got inf"),
        (["--set", "output_dir=/"], "output_dir: '/' is the root directory"),
        (["--output-dir", "/etc"], "output_dir: '/etc' is a system directory"),
        (["--set", 'drafter_fp8="e5m2"'], "drafter_fp8: got 'e5m2'; allowed: off, rowwise, rowwise_gw_hp"),
        (["--set", 'drafter_fp8_mlp="triton"'], "drafter_fp8_mlp: got 'triton'; allowed: composed, fused"),
    ],
    ids=[
        "set-huge-int",
        "set-deep",
        "set-lr-inf",
        "set-output-root",
        "output-dir-etc",
        "set-drafter-fp8",
        "set-drafter-fp8-mlp",
    ],
)
def test_the_cli_refuses_huge_integers_deep_nesting_and_bad_values_in_one_line(args: list[str], line: str) -> None:
    done = _train("--preset", "cpu-demo", *args, "--print-config")
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.startswith(f"specdec-train: config error: {line}"), done.stderr


def test_the_cli_refuses_a_config_file_with_a_5000_digit_integer_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "engine.toml"
    path.write_text(f'preset = "cpu-demo"\nsteps = {HUGE_INT}\n')
    done = _train("--config", str(path), "--print-config")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == f"specdec-train: config error: {path}: not valid TOML: an integer of more than 4300 digits\n"


@pytest.mark.parametrize(
    ("word", "module"),
    [
        ("eval", "engine.trainer.serve.evaluate"),
        ("regenerate", "engine.trainer.verifier.regenerate"),
        ("serve-check", "engine.trainer.serve.serve_check"),
    ],
)
def test_ctrl_c_in_a_subcommand_is_one_line_and_exit_130_not_a_traceback(
    word: str, module: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    from engine.trainer import __main__ as trainer_main

    seen: list[list[str]] = []

    def interrupted(argv: list[str]) -> int:
        seen.append(argv)
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module(module), "main", interrupted)
    # main's process-wide set-up (fault handler on stderr, SIGUSR1 stack dumps) stays out of the test process
    monkeypatch.setattr(trainer_main.faulthandler, "enable", lambda *_a, **_k: None)
    monkeypatch.setattr(trainer_main.stackdump, "install", lambda *_a, **_k: None)
    assert trainer_main.main([word, "--some", "args"]) == 130
    assert seen == [["--some", "args"]]
    assert capsys.readouterr().err == f"specdec-train {word}: interrupted\n"
