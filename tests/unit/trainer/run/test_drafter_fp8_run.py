"""drafter_fp8 in the engine (CPU): the key reaches the workers, a run with the drafter's GEMMs in FP8 learns and
keeps its parameters and checkpoints as a bf16 run does, and a device or a shape FP8 matmuls cannot take is refused
with one line naming the key."""

from __future__ import annotations

import importlib.util
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.trainer.config import ConfigError, TrainerConfig, from_dict
from engine.trainer.draft import model as draft_model
from engine.trainer.draft.fp8 import weight_layouts
from engine.trainer.run import assembly
from engine.trainer.run.assembly import check_drafter_fp8
from engine.trainer.run.loop import TrainingRun
from engine.trainer.run.worker import WorkerSettings
from engine.trainer.threads.metrics import EventLog


def make_config(out: Path, **overrides: Any) -> TrainerConfig:
    base: dict[str, Any] = {
        "target": "tiny",
        "tiny_layers": 4,  # the captured high layer is the last one: a few dozen steps show learning
        "data": "shipped",
        "buckets": [128],
        "batch_size": 2,
        "ttt_steps": 2,
        "draft_vocab_size": 128,
        "lr": 2e-3,
        "steps": 40,
        "output_dir": str(out),
        "torch_threads": 2,
        "drafter_fp8": "rowwise",
    }
    base.update(overrides)
    return from_dict(base)


def run(cfg: TrainerConfig, out: Path) -> tuple[TrainingRun, list[dict[str, Any]], str]:
    stdout = io.StringIO()
    events = EventLog(out / "events.jsonl", stdout=stdout)
    seen: list[dict[str, Any]] = []
    events.listeners.append(seen.append)
    engine = TrainingRun(cfg, events)
    engine.build()
    assert engine.run() == 0
    return engine, seen, stdout.getvalue()


def test_the_key_reaches_the_workers_settings() -> None:
    assert WorkerSettings.from_config(from_dict({"drafter_fp8": "rowwise_gw_hp"})).drafter_fp8 == "rowwise_gw_hp"
    assert WorkerSettings.from_config(from_dict({})).drafter_fp8 == "off"


def test_a_run_with_fp8_drafter_gemms_learns_and_keeps_float32_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quantised: list[list[str]] = []

    def counting(weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        quantised.append(list(weights) + list(inputs or {}))
        return weight_layouts(weights, inputs)

    monkeypatch.setattr(assembly, "weight_layouts", counting)  # what the engine's guarded function runs
    made: list[bool] = []
    real_fp8_weights = draft_model.Drafter.fp8_weights

    def recording(self: draft_model.Drafter, *args: Any, **kwargs: Any) -> Any:
        made.append(kwargs["grad_weight_fp8"])
        assert kwargs["layouts_fn"] is not None  # the engine's, not the eager default
        return real_fp8_weights(self, *args, **kwargs)

    monkeypatch.setattr(draft_model.Drafter, "fp8_weights", recording)
    engine, seen, said = run(make_config(tmp_path), tmp_path)
    worker = engine.workers[0]
    engine_line = next(line for line in said.splitlines() if "engine: " in line)
    assert "drafter GEMMs FP8 rowwise" in engine_line  # the run says what its drafter runs in
    # Every training step (and the warm-up's one forward) quantised the drafter's 8 weights and fc's input in one
    # call, all three GEMMs of each in FP8.
    once = [*draft_model.FP8_WEIGHTS, draft_model.FC_INPUT]
    assert quantised == [once] * (40 + 1) and made == [True] * (40 + 1)
    losses = [e["loss_total"] for e in seen if e["kind"] == "step"]
    assert len(losses) == 40
    start, end = sum(losses[:3]) / 3, sum(losses[-5:]) / 5
    assert end < 0.8 * start, (start, end)
    state = worker.final_state
    assert state is not None
    assert all(t.dtype == torch.float32 for t in state["model"].values() if t.is_floating_point())
    assert "fc.weight" in state["model"] and "lm_head.weight" in state["model"]  # the export reads the same keys


def test_a_linear_size_off_the_16_grid_is_refused_naming_it(tmp_path: Path) -> None:
    cfg = make_config(tmp_path, draft_vocab_size=120)
    engine = TrainingRun(cfg, EventLog(tmp_path / "events.jsonl", stdout=open(os.devnull, "w")))  # noqa: SIM115
    with pytest.raises(ConfigError) as err:
        engine.build()
    message = str(err.value)
    assert message.startswith("drafter_fp8: FP8 matmuls need every Linear's sizes in multiples of 16;"), message
    assert "lm_head is 120x64" in message and "\n" not in message


def test_a_target_directory_off_the_16_grid_is_refused_from_its_config_before_any_weight_loads(tmp_path: Path) -> None:
    # config.json alone, no weights and no tokenizer: the refusal has to come before anything loads.
    target = tmp_path / "target"
    target.mkdir()
    sizes = {"hidden_size": 256, "intermediate_size": 700, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1000, **sizes}
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8}))
    cfg = make_config(tmp_path / "out", target=str(target), draft_vocab_size=512)
    with pytest.raises(ConfigError) as err:
        check_drafter_fp8(cfg, [torch.device("cpu")])
    assert str(err.value) == (
        "drafter_fp8: FP8 matmuls need every Linear's sizes in multiples of 16; gate_proj is 700x256 (from the "
        "target's hidden and intermediate sizes and draft_vocab_size); use drafter_fp8 = 'off'"
    )
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8, "intermediate_size": 704}))
    check_drafter_fp8(cfg, [torch.device("cpu")])  # on the grid: nothing to refuse before the load
    # A multimodal wrapper's decoder sizes are its text_config's, as the engine reads them.
    wrapped = {"model_type": "llava", "text_config": {**config, "num_hidden_layers": 8}, "vision_config": {}}
    (target / "config.json").write_text(json.dumps(wrapped))
    with pytest.raises(ConfigError, match="gate_proj is 700x256"):
        check_drafter_fp8(cfg, [torch.device("cpu")])
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8, "intermediate_size": 704}))
    # The draft vocabulary is capped at the target's, as the engine builds it: 1000 is off the grid.
    with pytest.raises(ConfigError, match="lm_head is 1000x256"):
        check_drafter_fp8(
            make_config(tmp_path / "out", target=str(target), draft_vocab_size=4096), [torch.device("cpu")]
        )


def test_a_draft_config_knows_the_shapes_its_drafter_s_fp8_gemms_get() -> None:
    for heads, kv, dim, hidden, inter, vocab in [
        (4, 2, 16, 64, 176, 128),
        (8, 8, 32, 256, 704, 48),
        (2, 1, 64, 128, 256, 40),
    ]:
        cfg = draft_model.DraftConfig(
            hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=dim, intermediate_size=inter,
            vocab_size=300, draft_vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=1e4,
        )  # fmt: skip
        drafter = draft_model.Drafter(cfg, torch.zeros(300, hidden), torch.arange(vocab))
        # what the FP8 GEMMs are handed, read off the weights a step quantises (the q/k/v halves included)
        given = {name: tuple(w.weight.shape) for name, w in drafter.fp8_weights(None, grad_weight_fp8=True).items()}
        assert cfg.linear_shapes() == given
        assert list(cfg.linear_shapes()) == list(draft_model.FP8_WEIGHTS)


def test_a_gpu_before_hopper_is_refused_in_the_target_fp8_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda _d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None: "NVIDIA A100-SXM4-80GB")
    cfg = from_dict({"drafter_fp8": "rowwise"})
    with pytest.raises(ConfigError) as err:
        check_drafter_fp8(cfg, [torch.device("cuda:0")])
    assert str(err.value) == (
        "drafter_fp8 needs row-wise FP8 matmuls (compute capability 9.0+, Hopper); cuda:0 is NVIDIA A100-SXM4-80GB "
        "(8.0)"
    )
    check_drafter_fp8(from_dict({}), [torch.device("cuda:0")])  # off: nothing asked


def test_a_cpu_torch_without_row_wise_scaled_mm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    check_drafter_fp8(from_dict({"drafter_fp8": "rowwise"}), [torch.device("cpu")])  # this torch takes them
    monkeypatch.setattr(assembly, "cpu_rowwise_supported", lambda: False)
    with pytest.raises(ConfigError, match=r"^drafter_fp8: torch .*'s CPU _scaled_mm takes no row-wise scales"):
        check_drafter_fp8(from_dict({"drafter_fp8": "rowwise"}), [torch.device("cpu")])


def test_the_fused_mlp_on_cuda_registers_its_triton_kernels_before_a_run_or_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drafter_fp8_mlp = "fused" on a CUDA drafter: the config check imports Triton and registers the op's CUDA
    kernels before any thread starts; where Triton does not import (this CPU build of torch has none), one line says
    so and names the way out. The CPU needs neither. (The device check itself is stubbed: no GPU here.)"""
    from engine.trainer.draft import fp8_mlp

    monkeypatch.setattr(assembly, "fp8_unsupported_reason", lambda dev, key: None)
    monkeypatch.setattr(fp8_mlp, "_cuda_kernels", False)
    cfg = make_config(tmp_path / "out", drafter_fp8_mlp="fused")
    check_drafter_fp8(cfg, [torch.device("cpu")])  # the CPU takes the op's expressions: nothing to import
    assert fp8_mlp._cuda_kernels is False
    if importlib.util.find_spec("triton") is None:
        with pytest.raises(ConfigError) as err:
            check_drafter_fp8(cfg, [torch.device("cpu"), torch.device("cuda:0")])
        message = str(err.value)
        assert message.startswith("drafter_fp8_mlp = 'fused' needs Triton on CUDA, which does not import here (")
        assert message.endswith("; use drafter_fp8_mlp = 'composed'") and "\n" not in message
    else:  # a host with Triton: the kernels are registered, once
        check_drafter_fp8(cfg, [torch.device("cuda:0")])
        assert fp8_mlp._cuda_kernels is True
    monkeypatch.setattr(fp8_mlp, "_cuda_kernels", False)
    for way, recipe in (("composed", "rowwise"), ("fused", "rowwise_gw_hp")):  # neither runs the fused node
        check_drafter_fp8(
            make_config(tmp_path / "out", drafter_fp8=recipe, drafter_fp8_mlp=way), [torch.device("cuda:0")]
        )
        assert fp8_mlp._cuda_kernels is False  # Triton not asked for


def test_a_fused_mlp_run_reaches_the_one_node_every_step_and_trains_as_the_composed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drafter_fp8_mlp = "fused" from the config to the worker's unroll: every TTT step's backward of every training
    step makes its gradients' layouts in the one op; the run's losses are the composed run's (the CPU: bit for bit)."""
    from engine.trainer.draft import fp8_mlp

    assert WorkerSettings.from_config(from_dict({"drafter_fp8_mlp": "fused"})).drafter_fp8_mlp == "fused"
    assert WorkerSettings.from_config(from_dict({})).drafter_fp8_mlp == "composed"
    calls: list[int] = []
    real = fp8_mlp.gated_grads

    def counting(*args: Any) -> Any:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(fp8_mlp, "gated_grads", counting)
    losses = {}
    for way in ("composed", "fused"):
        calls.clear()
        _, seen, _ = run(make_config(tmp_path / way, steps=8, drafter_fp8_mlp=way), tmp_path / way)
        losses[way] = [e["loss_total"] for e in seen if e["kind"] == "step"]
        # 8 training steps and the warm-up's one, 2 TTT steps each: or none, composed
        assert len(calls) == (0 if way == "composed" else (8 + 1) * 2), (way, len(calls))
    assert len(losses["fused"]) == 8 and losses["fused"] == losses["composed"]
