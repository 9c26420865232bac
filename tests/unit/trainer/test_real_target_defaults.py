"""A Hugging Face target gets defaults that train a drafter meant to be served (a 32k draft vocabulary, TTT 7, warm-up
then cosine), not the tiny demo's; the ``specforge`` preset is SpecForge's recipe for side-by-side runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.trainer.config import ConfigError, from_dict, load_toml, preset

REPO_ROOT = Path(__file__).resolve().parents[3]
SERVED = {"draft_vocab_size": 32000, "ttt_steps": 7, "lr": 1e-4, "schedule": "cosine", "warmup_ratio": 0.015}


def chosen(cfg: object) -> dict[str, object]:
    return {key: getattr(cfg, key) for key in SERVED}


def test_a_hugging_face_target_without_a_preset_gets_a_served_drafters_defaults(tmp_path: Path) -> None:
    assert chosen(from_dict({"target": str(tmp_path)})) == SERVED
    toml = tmp_path / "engine.toml"
    toml.write_text(f'target = "{tmp_path}"\nsteps = 2000\n')
    cfg = load_toml(toml)
    assert chosen(cfg) == SERVED and cfg.warmup == 30  # 1.5 % of 2000 steps, rounded down as SpecForge does


def test_what_the_config_sets_stays_and_a_builtin_target_keeps_the_small_defaults(tmp_path: Path) -> None:
    own = from_dict({"target": str(tmp_path), "draft_vocab_size": 4096, "warmup_steps": 10, "schedule": "linear"})
    assert (own.draft_vocab_size, own.warmup_steps, own.warmup_ratio, own.schedule) == (4096, 10, 0.0, "linear")
    assert (own.ttt_steps, own.lr) == (7, 1e-4)
    tiny = from_dict({"target": "tiny"})
    assert (tiny.draft_vocab_size, tiny.ttt_steps, tiny.schedule, tiny.warmup) == (128, 3, "constant", 0)
    demo = from_dict({"target": str(tmp_path)}, preset("cpu-demo"))  # a preset is a choice: it is kept
    assert (demo.draft_vocab_size, demo.ttt_steps) == (128, 3)


def test_the_command_line_with_set_target_alone_prints_the_served_defaults(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("SPECDEC_RUN_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "engine.trainer", "--set", f'target="{tmp_path}"', "--print-config"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = set(done.stdout.splitlines())
    for key, value in SERVED.items():
        assert f"{key} = {value!r}" in lines
    assert "drafter_mode = 'replicas'" in lines and "drafter_lrs = None" in lines  # not the demo's two-rate sweep


def test_the_specforge_preset_is_specforges_recipe_on_the_h200_layout() -> None:
    cfg, layout = preset("specforge"), preset("h200-single")
    assert (cfg.lr, cfg.schedule, cfg.warmup_ratio, cfg.warmup_steps) == (1e-4, "cosine", 0.015, 0)
    assert (cfg.max_grad_norm, cfg.adam_betas, cfg.weight_decay) == (0.5, [0.9, 0.999], 0.0)
    assert (cfg.draft_vocab_size, cfg.ttt_steps, cfg.loss_mean) == (32000, 7, "all_positions")
    assert (cfg.buckets, cfg.batch_size, cfg.target_devices, cfg.compile) == (
        layout.buckets, layout.batch_size, layout.target_devices, layout.compile,
    )  # fmt: skip
    assert cfg.warmup == 30  # int(0.015 * 2000)


def test_the_warm_up_share_and_the_betas_reach_the_schedule_and_the_optimizer() -> None:
    import torch

    from engine.trainer.run import assembly

    cfg = from_dict({"target": "tiny", "steps": 200, "warmup_ratio": 0.05, "schedule": "cosine"})
    factor = assembly.lr_lambda(cfg)
    assert [factor(s) for s in (0, 4, 9)] == [0.1, 0.5, 1.0]  # 10 warm-up steps, then the cosine from 1
    assert factor(10) == 1.0 and factor(105) == pytest.approx(0.5) and factor(200) == pytest.approx(0.0)
    layer = torch.nn.Linear(2, 2)
    drafter = type("D", (), {"trainable_parameters": lambda self: list(layer.parameters())})()
    optimizer, _ = assembly.build_optimizer(from_dict({"target": "tiny", "adam_betas": [0.8, 0.999]}), drafter, 0)
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.999)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"warmup_ratio": 1.0}, "warmup_ratio: a share of steps, >= 0 and below 1"),
        (
            {"warmup_ratio": 0.1, "warmup_steps": 5},
            "warmup_ratio: set warmup_steps (5) or warmup_ratio (0.1), not both",
        ),
        ({"adam_betas": [0.9]}, "adam_betas: got [0.9]; two numbers >= 0 and below 1"),
    ],
)
def test_a_wrong_warm_up_share_or_betas_is_a_config_error_naming_the_key(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_dict({"target": "tiny", **values})


def test_a_layer_setting_one_way_of_warming_up_replaces_the_other_it_inherits(tmp_path: Path) -> None:
    """A preset, the file and --set are layers: warmup_steps set over an inherited warmup_ratio (the specforge
    preset's, a Hugging Face target's default) turns the ratio off, and the other way round."""
    over_preset = from_dict({"warmup_steps": 50}, preset("specforge"))
    assert (over_preset.warmup_steps, over_preset.warmup_ratio, over_preset.warmup) == (50, 0.0, 50)
    ratio_over_steps = from_dict({"warmup_ratio": 0.02}, preset("h200-single"))  # its warmup_steps = 50
    assert (ratio_over_steps.warmup_steps, ratio_over_steps.warmup_ratio) == (0, 0.02)
    toml = tmp_path / "engine.toml"
    toml.write_text(f'target = "{tmp_path}"\nsteps = 2000\n')  # the served defaults: warmup_ratio 0.015
    file_then_set = from_dict({"warmup_steps": 100}, load_toml(toml))
    assert (file_then_set.warmup_steps, file_then_set.warmup_ratio, file_then_set.warmup) == (100, 0.0, 100)
    toml.write_text('preset = "specforge"\nwarmup_steps = 10\n')  # the file over its preset
    assert (load_toml(toml).warmup_steps, load_toml(toml).warmup_ratio) == (10, 0.0)


def test_the_command_line_sets_warmup_steps_over_the_specforge_preset(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("SPECDEC_RUN_DIR", None)
    done = subprocess.run(
        [sys.executable, "-m", "engine.trainer", "--preset", "specforge", "--set", "warmup_steps=50",
         "--set", 'target_devices=["cpu"]', "--set", 'drafter_devices=["cpu"]', "--print-config"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = set(done.stdout.splitlines())
    assert "warmup_steps = 50" in lines and "warmup_ratio = 0.0" in lines


def test_both_ways_of_warming_up_set_in_one_layer_stay_an_error() -> None:
    with pytest.raises(ConfigError, match=re.escape("set warmup_steps (5) or warmup_ratio (0.1), not both")):
        from_dict({"warmup_steps": 5, "warmup_ratio": 0.1}, preset("specforge"))
