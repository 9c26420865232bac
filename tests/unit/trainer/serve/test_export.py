"""`specdec-train export`: the served EAGLE-3 layouts (names, shapes, dtypes, config), a round trip back into our
drafter, the run's export event, and every kind of bad input (a clear error, nothing written)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from engine.protocol import RunInfo, StatusReply, from_json
from engine.supervisor.records import RunScanner
from engine.trainer import checkpoint as ckpt
from engine.trainer.__main__ import main as train_main
from engine.trainer.config import from_dict
from engine.trainer.draft.model import DraftConfig, Drafter
from engine.trainer.run.loop import TrainingRun
from engine.trainer.serve import export
from engine.trainer.threads.metrics import EventLog
from tui.cli.monitor import format_status
from tui.dashboard.widgets.run_timeline import TimelineModel

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB = 32, 2, 1, 16, 64, 80, 24
TARGET_LAYERS = [1, 2, 3]

EAGLE3_NAMES = {
    "fc.weight": (HIDDEN, 3 * HIDDEN),
    "norm.weight": (HIDDEN,),
    "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
    "d2t": (DRAFT_VOCAB,),
    "t2d": (VOCAB,),
    "midlayer.input_layernorm.weight": (HIDDEN,),
    "midlayer.hidden_norm.weight": (HIDDEN,),
    "midlayer.self_attn.q_proj.weight": (HEADS * HEAD_DIM, 2 * HIDDEN),
    "midlayer.self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, 2 * HIDDEN),
    "midlayer.self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, 2 * HIDDEN),
    "midlayer.self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
    "midlayer.post_attention_layernorm.weight": (HIDDEN,),
    "midlayer.mlp.gate_proj.weight": (INTER, HIDDEN),
    "midlayer.mlp.up_proj.weight": (INTER, HIDDEN),
    "midlayer.mlp.down_proj.weight": (HIDDEN, INTER),
}


def tiny_drafter(seed: int = 0) -> tuple[Drafter, torch.Tensor]:
    cfg = DraftConfig(HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, DRAFT_VOCAB, rms_norm_eps=1e-6, rope_theta=5e4)
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(VOCAB, HIDDEN, generator=g)
    draft_to_target = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT_VOCAB]).values
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = Drafter(cfg, embed, draft_to_target)
        with torch.no_grad():  # norms away from 1: a norm weight in the wrong place changes the output
            for name, p in drafter.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    return drafter, embed


def write_checkpoint(output_dir: Path, drafters: dict[str, Drafter], step: int = 7, **meta_extra: Any) -> Path:
    first = next(iter(drafters.values()))
    meta = {
        "config": {"target": "tiny", "ttt_steps": 3, "tiny_hidden": HIDDEN, "tiny_layers": 4},
        "mode": "independent" if len(drafters) > 1 else "replicas",
        "draft_config": first.cfg.to_dict(),
        "target_layers": TARGET_LAYERS,
        **meta_extra,
    }
    states = {name: {"model": d.state_dict(), "step": step} for name, d in drafters.items()}
    return ckpt.save_checkpoint(output_dir, step, states, meta, first.d2t + torch.arange(DRAFT_VOCAB), keep=3)


def tensors_of(out_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())  # safe_open is not a mapping: no iteration over it
        return {k: f.get_tensor(k) for k in names}


def inputs(seed: int = 1, t: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, t, 3 * HIDDEN, generator=g), torch.randint(0, VOCAB, (1, t), generator=g)


@pytest.fixture
def replicas_ckpt(tmp_path: Path) -> tuple[Path, Drafter, torch.Tensor]:
    drafter, embed = tiny_drafter()
    path = write_checkpoint(tmp_path / "out", {"replicas": drafter})
    return path, drafter, embed


# --- the served layouts ---------------------------------------------------------------------------------------------
def test_eagle3_export_has_exactly_the_names_shapes_and_dtypes_servers_load(replicas_ckpt: Any, tmp_path: Path) -> None:
    path, drafter, _ = replicas_ckpt
    result = export.export_checkpoint(path, tmp_path / "served")
    tensors = tensors_of(result.out_dir)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == EAGLE3_NAMES
    assert not any("embed_tokens" in k for k in tensors)
    for name, t in tensors.items():
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(name, torch.bfloat16)
        assert t.dtype == want, name
    assert torch.equal(tensors["d2t"], drafter.d2t) and torch.equal(tensors["t2d"], drafter.t2d)
    assert torch.equal(tensors["midlayer.mlp.down_proj.weight"], drafter.layer.down_proj.weight.to(torch.bfloat16))
    assert sorted(p.name for p in result.out_dir.iterdir()) == ["config.json", "model.safetensors"]
    assert result.params == sum(p.numel() for p in drafter.parameters())


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_exported_files_get_a_normal_files_mode_under_the_umask(
    replicas_ckpt: Any, tmp_path: Path, umask: int, mode: int
) -> None:
    """A server running as another user must read model.safetensors (safetensors itself creates it 0600)."""
    path, _, _ = replicas_ckpt
    old = os.umask(umask)
    try:
        result = export.export_checkpoint(path, tmp_path / "served")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in result.out_dir.iterdir()}
    assert modes == {"config.json": mode, "model.safetensors": mode}


def test_eagle3_config_carries_sizes_vocab_rope_and_aux_layers_per_server(replicas_ckpt: Any, tmp_path: Path) -> None:
    path, _, _ = replicas_ckpt
    out = export.export_checkpoint(path, tmp_path / "served").out_dir
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    expected = {
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT_VOCAB,
        "target_hidden_size": HIDDEN,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "norm_before_residual": False,
        "rope_theta": 5e4,
        "rope_scaling": None,
        "hidden_act": "silu",
    }
    assert {k: cfg[k] for k in expected} == expected
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e4}
    # SGLang: layer outputs (it adds 1); vLLM: layer inputs (= ours + 1).
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": TARGET_LAYERS, "use_aux_hidden_state": True}
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in TARGET_LAYERS]
    assert cfg["max_position_embeddings"] == 4096  # the tiny target's
    assert cfg["specdec_export"]["step"] == 7 and cfg["specdec_export"]["drafter"] == "replicas"


def test_rope_scaling_the_drafter_trained_with_is_exported_as_is(tmp_path: Path) -> None:
    drafter, _ = tiny_drafter()
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    meta_cfg = {**drafter.cfg.to_dict(), "rope_scaling": scaling}
    path = write_checkpoint(tmp_path / "out", {"replicas": drafter}, draft_config=meta_cfg)
    cfg = json.loads((export.export_checkpoint(path, tmp_path / "served").out_dir / "config.json").read_text())
    assert cfg["rope_scaling"] == scaling
    assert cfg["rope_parameters"] == {**scaling, "rope_theta": 5e4}


def test_speculators_export_has_its_config_layout_and_layers_0_names(replicas_ckpt: Any, tmp_path: Path) -> None:
    path, _, _ = replicas_ckpt
    out = export.export_checkpoint(path, tmp_path / "spec", fmt="speculators", verifier="/models/tiny").out_dir
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and cfg["architectures"] == ["Eagle3Speculator"]
    layer = cfg["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["vocab_size"] == VOCAB and layer["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["norm_before_residual"] is False
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in TARGET_LAYERS]
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 3
    assert spec["verifier"] == {"name_or_path": "/models/tiny", "architectures": ["LlamaForCausalLM"]}
    names = set(tensors_of(out))
    assert names == {k.replace("midlayer.", "layers.0.") for k in EAGLE3_NAMES}


@pytest.mark.parametrize("fmt", export.FORMATS)
def test_round_trip_gives_the_checkpointed_drafters_logits(replicas_ckpt: Any, tmp_path: Path, fmt: str) -> None:
    path, drafter, embed = replicas_ckpt
    out = export.export_checkpoint(path, tmp_path / fmt, fmt=fmt).out_dir
    loaded = export.drafter_from_export(out, embed)
    rounded, _ = tiny_drafter()  # the checkpoint's weights, rounded to bfloat16 as the export stores them
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hidden3, ids = inputs()
    ours = export.drafter_logits(loaded, hidden3, ids, ttt_steps=2)
    assert ours.shape == (2, 1, 12, DRAFT_VOCAB)
    assert (ours - export.drafter_logits(rounded, hidden3, ids, ttt_steps=2)).abs().max().item() < 1e-5
    # bfloat16 storage moves the fp32 drafter's logits only a little
    assert (ours - export.drafter_logits(drafter, hidden3, ids, ttt_steps=2)).abs().max().item() < 0.1


# --- every field a server reads with a default, written as trained and read back ----------------------------------
def trained_values(drafter: Drafter) -> dict[str, Any]:
    """What the checkpointed drafter computes, from its weights and the meta it was trained with (not from the
    exporter's tables): the flags from draft/model.py's forward, the sizes from the weights' shapes."""
    return {
        "norm_before_residual": False,  # DraftDecoderLayer: the residual is fc's output, hidden_norm only feeds q/k/v
        "norm_before_fc": False,  # Drafter.fc reads the three captured states concatenated, no norm before it
        "fc_norm": False,  # nor one per state: the drafter has no such weights
        "norm_output": False,  # the next TTT step reads the layer's output before Drafter.norm
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in TARGET_LAYERS],  # outputs of i = inputs of i + 1
        "draft_vocab_size": int(drafter.lm_head.weight.shape[0]),
        "target_hidden_size": int(drafter.fc.weight.shape[1]) // 3,
    }


SERVED_FIELDS = list(trained_values(tiny_drafter()[0]))


@pytest.mark.parametrize("fmt", export.FORMATS)
@pytest.mark.parametrize("field", SERVED_FIELDS)
def test_each_field_servers_read_with_a_default_is_written_as_trained_and_read_back(
    replicas_ckpt: Any, tmp_path: Path, field: str, fmt: str
) -> None:
    path, drafter, _ = replicas_ckpt
    out = export.export_checkpoint(path, tmp_path / "served", fmt=fmt).out_dir
    cfg = json.loads((out / "config.json").read_text())
    trained = trained_values(drafter)[field]
    assert cfg.get(field, "absent") == trained  # explicit, at the top level where vLLM and SGLang read it
    assert export.served_settings(cfg)[field] == trained  # and a server's reading of the file gets that value


def test_served_settings_apply_vllms_default_for_the_layout_to_absent_flags() -> None:
    minimal = {"draft_vocab_size": 8, "hidden_size": 16}
    read = export.served_settings(minimal)
    assert read["norm_before_residual"] is False  # llama_eagle3.py: getattr(config, "norm_before_residual", False)
    assert (read["norm_before_fc"], read["fc_norm"], read["norm_output"]) == (False, False, False)
    assert read["target_hidden_size"] == 16 and read["eagle_aux_hidden_state_layer_ids"] == []
    layered = {
        "speculators_model_type": "eagle3",
        "draft_vocab_size": 8,
        "transformer_layer_config": {"hidden_size": 16},
    }
    read = export.served_settings(layered)
    assert read["norm_before_residual"] is True  # vLLM's speculators path (update_eagle3): absent means true
    assert (read["norm_before_fc"], read["fc_norm"], read["norm_output"]) == (False, False, False)


@pytest.mark.parametrize("flag", SERVED_FIELDS[:4])
def test_an_export_whose_flags_this_drafter_cannot_compute_is_refused_by_our_loader(
    replicas_ckpt: Any, tmp_path: Path, flag: str
) -> None:
    path, _, embed = replicas_ckpt
    out = export.export_checkpoint(path, tmp_path / "served").out_dir
    cfg = json.loads((out / "config.json").read_text())
    cfg[flag] = not cfg[flag]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(export.ExportError, match=f"{flag} is true; this drafter computes {flag} = false"):
        export.drafter_from_export(out, embed)


def test_a_speculators_export_without_norm_before_residual_is_read_as_vllm_reads_it(
    replicas_ckpt: Any, tmp_path: Path
) -> None:
    """A speculators config that leaves the flag out (this exporter's before it wrote it) is served with
    norm_before_residual true by vLLM's speculators path: not this drafter's computation."""
    path, _, embed = replicas_ckpt
    out = export.export_checkpoint(path, tmp_path / "served", fmt="speculators").out_dir
    cfg = json.loads((out / "config.json").read_text())
    del cfg["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(export.ExportError, match=r"norm_before_residual is true \(absent: vLLM's default in this"):
        export.drafter_from_export(out, embed)


def test_an_eagle3_layout_export_without_norm_before_residual_loads_as_vllm_defaults_it_false(
    replicas_ckpt: Any, tmp_path: Path
) -> None:
    """The LlamaForCausalLMEagle3 layout (SpecForge's export_to_sglang writes no flags): vLLM's llama_eagle3 reads
    an absent norm_before_residual as false, this drafter's computation."""
    path, drafter, embed = replicas_ckpt
    out = export.export_checkpoint(path, tmp_path / "served", fmt="eagle3").out_dir
    cfg = json.loads((out / "config.json").read_text())
    del cfg["norm_before_residual"]
    (out / "config.json").write_text(json.dumps(cfg))
    assert export.drafter_from_export(out, embed).cfg == drafter.cfg


# --- a real run: output dir, latest checkpoint, the export event, status ---------------------------------------------
def test_engine_output_dir_exports_its_latest_checkpoint_and_records_the_event(tmp_path: Path, capsys: Any) -> None:
    out = tmp_path / "engine-out"
    settings: dict[str, Any] = {"target": "tiny", "target_devices": ["cpu"], "drafter_devices": ["cpu"]}
    settings.update(data="random", buckets=[64], batch_size=1, ttt_steps=2, draft_vocab_size=64)
    settings.update(vocab_sample_batches=2, steps=2, checkpoint_every=1, torch_threads=1, tiny_hidden=32)
    cfg = from_dict({**settings, "output_dir": str(out)})
    events = EventLog(out / "events.jsonl", stdout=open(os.devnull, "w"))  # noqa: SIM115
    engine = TrainingRun(cfg, events)
    engine.build()
    assert engine.run() == 0
    events.close()
    assert train_main(["export", str(out), str(tmp_path / "served")]) == 0
    printed = capsys.readouterr().out
    assert "checkpoint step_00000002 (latest of 2 in" in printed
    assert f"-> {tmp_path / 'served'} [eagle3]" in printed and "bfloat16" in printed
    cfg_json = json.loads((tmp_path / "served" / "config.json").read_text())
    assert cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == engine.targets[0].layer_ids
    assert cfg_json["rope_theta"] == engine.workers[0].training.drafter.cfg.rope_theta
    loaded = export.drafter_from_export(tmp_path / "served", engine.targets[0].embed_weight())
    assert loaded.cfg == engine.workers[0].training.drafter.cfg
    last = json.loads((out / "events.jsonl").read_text().splitlines()[-1])
    assert {k: last[k] for k in ("kind", "path", "step", "format", "drafter")} == {
        "kind": "export", "path": str(tmp_path / "served"), "step": 2, "format": "eagle3", "drafter": "replicas",
    }  # fmt: skip
    assert RunScanner(out, None).poll().last_export == str(tmp_path / "served")


def test_supervised_run_gets_the_event_through_its_checkpoints_link(replicas_ckpt: Any, tmp_path: Path) -> None:
    # <run_root>/engine/out holds the checkpoints; <run_root>/runs/<id>/checkpoints links there (supervisor layout)
    root = tmp_path / "run-root"
    engine_out = root / "engine" / "out"
    engine_out.parent.mkdir(parents=True)
    (tmp_path / "out").rename(engine_out)
    older, newer = root / "runs" / "20260101-000000-aaaa", root / "runs" / "20260102-000000-bbbb"
    for i, run in enumerate((older, newer)):
        run.mkdir(parents=True)
        (run / "checkpoints").symlink_to(engine_out / "checkpoints", target_is_directory=True)
        (run / "events.jsonl").write_text("")
        os.utime(run / "events.jsonl", (1000 + i, 1000 + i))
    result = export.export_checkpoint(engine_out, tmp_path / "served")
    assert result.events_path == newer / "events.jsonl"
    assert json.loads((newer / "events.jsonl").read_text())["kind"] == "export"
    assert (older / "events.jsonl").read_text() == ""


def test_status_and_dashboard_show_the_last_export() -> None:
    run = {"run_id": "r1", "run_dir": "/runs/r1", "state": "exited", "last_export": "/srv/drafter-eagle3"}
    snap = {"host": {}, "gpus": [], "processes": {}, "run": run, "anomalies": []}
    text = format_status(from_json(StatusReply, snap), None, "host")
    assert "exported /srv/drafter-eagle3" in text
    timeline = TimelineModel()
    timeline.from_run(from_json(RunInfo, run))
    assert timeline.last_export == "/srv/drafter-eagle3"


def test_export_without_a_run_writes_no_events_file(replicas_ckpt: Any, tmp_path: Path) -> None:
    path, _, _ = replicas_ckpt
    result = export.export_checkpoint(path, tmp_path / "served")
    assert result.events_path is None and not (tmp_path / "out" / "events.jsonl").exists()


# --- independent mode ---------------------------------------------------------------------------------------------
def test_independent_checkpoint_needs_drafter_and_names_the_choices(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "out", {"drafter0": tiny_drafter(0)[0], "drafter1": tiny_drafter(1)[0]})
    with pytest.raises(export.ExportError, match=r"has 2 drafters; choose one with --drafter: drafter0, drafter1"):
        export.export_checkpoint(path, tmp_path / "served")
    with pytest.raises(export.ExportError, match=r"no drafter 'drafter7'.*drafter0, drafter1"):
        export.export_checkpoint(path, tmp_path / "served", drafter="drafter7")
    assert not (tmp_path / "served").exists()
    result = export.export_checkpoint(path, tmp_path / "served", drafter="drafter1")
    one = tiny_drafter(1)[0]
    assert result.drafter == "drafter1"
    assert torch.equal(tensors_of(result.out_dir)["fc.weight"], one.fc.weight.to(torch.bfloat16))


def test_the_documented_command_exports_each_drafter_of_an_independent_run_into_its_own_folder(
    tmp_path: Path, capsys: Any
) -> None:
    path = write_checkpoint(tmp_path / "out", {"drafter0": tiny_drafter(0)[0], "drafter1": tiny_drafter(1)[0]})
    assert train_main(["export", str(path), str(tmp_path / "served")]) == 0
    said = capsys.readouterr().out
    assert said.startswith("2 drafters, each in its own folder (--drafter NAME exports one):"), said
    for i in (0, 1):
        got = tensors_of(tmp_path / "served" / f"drafter{i}")["fc.weight"]
        assert torch.equal(got, tiny_drafter(i)[0].fc.weight.to(torch.bfloat16))
    assert sorted(p.name for p in (tmp_path / "served").iterdir()) == ["drafter0", "drafter1"]
    assert train_main(["export", str(path), str(tmp_path / "one"), "--drafter", "drafter1"]) == 0
    assert (tmp_path / "one" / "config.json").is_file()


# --- bad input: one clear line, nothing written ----------------------------------------------------------------
def assert_refused(capsys: Any, argv: list[str], out_dir: Path, message: str) -> None:
    before = set(out_dir.parent.iterdir()) if out_dir.parent.exists() else set()
    assert train_main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec-train export: error: ") and "\n" not in err
    assert message in err, err
    after = set(out_dir.parent.iterdir()) if out_dir.parent.exists() else set()
    assert after == before  # no output dir, no temporary left behind


def test_an_out_dir_under_a_file_is_refused(tmp_path: Path, capsys: Any) -> None:
    path = write_checkpoint(tmp_path / "out", {"drafter0": tiny_drafter(0)[0]})
    (tmp_path / "afile").write_text("keep me\n")
    served = tmp_path / "afile" / "sub"
    assert train_main(["export", str(path), str(served)]) == 2
    err = capsys.readouterr().err
    afile = tmp_path / "afile"
    assert err == f"specdec-train export: error: {served}: cannot write an export there ({afile}: File exists)\n"
    assert (tmp_path / "afile").read_text() == "keep me\n"


def test_missing_path_is_refused(tmp_path: Path, capsys: Any) -> None:
    assert_refused(capsys, [str(tmp_path / "nope"), str(tmp_path / "served")], tmp_path / "served", "does not exist")


def test_a_file_is_refused(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "f.pt").write_bytes(b"x")
    assert_refused(capsys, [str(tmp_path / "f.pt"), str(tmp_path / "s")], tmp_path / "s", "is not a directory")


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "empty").mkdir()
    out = tmp_path / "s"
    assert_refused(capsys, [str(tmp_path / "empty"), str(out)], out, "neither a checkpoint (no meta.json)")


def test_a_checkpoint_still_being_written_is_refused(tmp_path: Path, capsys: Any) -> None:
    tmp = tmp_path / "out" / "checkpoints" / ".tmp-step_00000009-123-456"
    tmp.mkdir(parents=True)
    (tmp / "replicas.pt").write_bytes(b"partial")
    out = tmp_path / "s"
    assert_refused(capsys, [str(tmp), str(out)], out, "still being written")
    assert_refused(capsys, [str(tmp_path / "out"), str(out)], out, "no complete checkpoint yet: one is still being")


def test_a_step_directory_without_meta_is_refused(tmp_path: Path, capsys: Any) -> None:
    step = tmp_path / "out" / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    assert_refused(capsys, [str(step), str(tmp_path / "s")], tmp_path / "s", "incomplete checkpoint: no meta.json")


def test_an_output_dir_without_checkpoints_is_refused(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "out" / "checkpoints").mkdir(parents=True)
    assert_refused(capsys, [str(tmp_path / "out"), str(tmp_path / "s")], tmp_path / "s", "has no checkpoint")


def test_an_existing_output_directory_is_refused(replicas_ckpt: Any, tmp_path: Path, capsys: Any) -> None:
    path, _, _ = replicas_ckpt
    out = tmp_path / "served"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert_refused(capsys, [str(path), str(out)], out, "exists and is not empty")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "keep.txt").unlink()  # an empty directory is taken
    assert train_main(["export", str(path), str(out)]) == 0
    assert (out / "model.safetensors").is_file()


def test_damaged_meta_is_refused(replicas_ckpt: Any, tmp_path: Path, capsys: Any) -> None:
    path, _, _ = replicas_ckpt
    (path / "meta.json").write_text("{not json")
    assert_refused(capsys, [str(path), str(tmp_path / "s")], tmp_path / "s", "cannot read")


def test_a_missing_drafter_state_is_refused(replicas_ckpt: Any, tmp_path: Path, capsys: Any) -> None:
    path, _, _ = replicas_ckpt
    (path / "replicas.pt").unlink()
    assert_refused(capsys, [str(path), str(tmp_path / "s")], tmp_path / "s", "replicas.pt is missing")


def test_a_parameter_the_exporter_does_not_know_is_refused(tmp_path: Path, capsys: Any) -> None:
    drafter, _ = tiny_drafter()
    drafter.register_parameter("extra_gate", torch.nn.Parameter(torch.ones(3)))
    path = write_checkpoint(tmp_path / "out", {"replicas": drafter})
    assert_refused(capsys, [str(path), str(tmp_path / "s")], tmp_path / "s", "'extra_gate' has no EAGLE-3 serving")


def test_an_unknown_format_is_a_usage_error(replicas_ckpt: Any, tmp_path: Path) -> None:
    path, _, _ = replicas_ckpt
    with pytest.raises(SystemExit) as exc:
        train_main(["export", str(path), str(tmp_path / "s"), "--format", "medusa"])
    assert exc.value.code == 2 and not (tmp_path / "s").exists()
