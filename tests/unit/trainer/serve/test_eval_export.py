"""`specdec-train eval` counts what the served export accepts: a checkpoint through the export's bfloat16, and an
exported directory itself, ours or another trainer's (SpecForge's LlamaForCausalLMEagle3 layout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from engine.trainer.data.sources import shipped_corpus_path
from engine.trainer.draft.model import DraftConfig, Drafter
from engine.trainer.serve import export
from engine.trainer.serve.evaluate import DrafterProposer, load_drafter, main
from engine.trainer.serve.exported import ExportedDrafterError, aux_layer_ids, load_exported, sglang_differs
from engine.trainer.threads.metrics import EventLog
from engine.trainer.verifier.model import load_target, load_tokenizer

REPO = Path(__file__).resolve().parents[4]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A one-drafter run on the tiny target (3 steps, lr high enough to move off the init), and its export."""
    from engine.trainer.config import from_dict
    from engine.trainer.run.loop import TrainingRun

    tmp = tmp_path_factory.mktemp("evalexport")
    out, corpus = tmp / "out", tmp / "small.jsonl"
    corpus.write_text("\n".join(shipped_corpus_path().read_text(encoding="utf-8").splitlines()[:64]) + "\n")
    cfg = from_dict(
        {
            "target": "tiny",
            "data": str(corpus),
            "buckets": [256],
            "batch_size": 2,
            "ttt_steps": 2,
            "draft_vocab_size": 96,
            "lr": 1e-2,
            "steps": 3,
            "output_dir": str(out),
            "torch_threads": 1,
        }
    )
    with open(os.devnull, "w") as devnull:
        engine = TrainingRun(cfg, EventLog(out / "events.jsonl", stdout=devnull))
        engine.build()
        assert engine.run() == 0
    exported = tmp / "export"
    export.export_checkpoint(out, exported, record=False)
    return out, exported, corpus


def test_a_checkpoints_drafter_is_evaluated_with_its_weights_as_exported(run: tuple[Path, Path, Path]) -> None:
    out, exported, _corpus = run
    from engine.trainer import checkpoint as ckpt

    path, _ = ckpt.resolve_checkpoint(out)
    target = load_target("tiny", torch.device("cpu"), tokenizer=load_tokenizer("tiny"), layer_ids=None, seed=0,
                         dtype=torch.float32)  # fmt: skip
    drafter = load_drafter(path, "replicas", target, torch.device("cpu"))
    _config, served = export.read_export(exported)
    state = drafter.state_dict()
    raw = ckpt.load_drafter_state(path, "replicas")["model"]
    moved = 0
    for name, tensor in served.items():
        assert torch.equal(state[name], tensor.to(state[name].dtype)), name
        moved += int(not torch.equal(raw[name], state[name]))
    assert moved > 0  # the float32 checkpoint differs from the export: evaluating it would count another drafter


def _eval(*argv: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main([*argv, "--k", "3", "--conversations", "3", "--max-new-tokens", "24", "--count", "vllm", "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def test_eval_of_a_run_equals_eval_of_its_export_to_the_count(
    run: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out, exported, corpus = run
    of_run = _eval("--checkpoint", str(out), "--outputs", capsys=capsys)["drafters"]["replicas"]
    of_export = _eval("--export", str(exported), "--target", "tiny", "--data", str(corpus), "--outputs", capsys=capsys)
    got = of_export["drafters"]["export"]
    for key in ("accepted_hist", "rounds", "accepted_per_position", "new_tokens", "outputs"):
        assert got[key] == of_run[key], key
    assert got["rounds"] >= 10
    assert of_export["target_layers"] == [1, 3, 4]  # the export's aux ids, as trained


@pytest.mark.parametrize("flags, as_served", [([], False), (["--as-served"], True)])
def test_eval_of_an_export_reports_as_served_as_it_was_asked(
    run: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str], flags: list[str], as_served: bool
) -> None:
    _out, exported, corpus = run
    argv = ["--export", str(exported), "--target", "tiny", "--data", str(corpus), "--k", "2", "--conversations", "1"]
    assert main([*argv, "--max-new-tokens", "4", *flags, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["as_served"] is as_served and summary["export"] == str(exported)
    assert main([*argv, "--max-new-tokens", "4", *flags]) == 0
    heading = capsys.readouterr().out.splitlines()[0]
    assert heading.startswith(f"export {exported}, target tiny layers [1, 3, 4], k=2, rope offset True")
    assert heading.endswith(f"{' (as served)' if as_served else ''}, counting stop")


def specforge_layout(drafter: Drafter, directory: Path, **extra: Any) -> Path:
    """What SpecForge's export_to_sglang writes: the model's own names, transformers' config (rope_parameters, no
    head_dim, no aux layer ids), bfloat16 weights."""
    cfg = drafter.cfg
    tensors = {export.served_name(k, "eagle3"): v for k, v in drafter.state_dict().items()}
    tensors = {k: v if k in ("d2t", "t2d") else v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "num_hidden_layers": 1,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "torch_dtype": "bfloat16",
        **extra,
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def small_drafter() -> Drafter:
    cfg = DraftConfig(hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=64, vocab_size=64,
                      draft_vocab_size=48, rms_norm_eps=1e-5, rope_theta=500.0)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        d2t = torch.sort(torch.randperm(64, generator=g)[:48]).values
        return Drafter(cfg, torch.randn(64, 32, generator=g), d2t).eval()


def test_another_trainers_export_proposes_what_the_same_weights_propose_here(tmp_path: Path) -> None:
    drafter = small_drafter()
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # as exported: the comparison is then exact
    loaded = load_exported(specforge_layout(drafter, tmp_path / "sf"), drafter.embed_table)
    assert loaded.layer_ids is None  # no aux ids written: the servers' default layers
    assert loaded.drafter.cfg == drafter.cfg  # head_dim from hidden / heads, rope_theta from rope_parameters
    g = torch.Generator().manual_seed(4)
    seq = torch.randint(0, 64, (12,), generator=g).tolist()
    hidden3 = torch.randn(1, 11, 96, generator=g)
    ours = DrafterProposer(drafter, rope_offset=True).chain_logits(seq, hidden3, 3)
    theirs = DrafterProposer(loaded.drafter, rope_offset=True).chain_logits(seq, hidden3, 3)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "extra,fragment",
    [
        ({"norm_before_residual": True}, "norm_before_residual is set"),
        ({"fc_norm": True}, "fc_norm is set"),
        ({"norm_output": True}, "norm_output is set"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 500.0}}, "rope scaling ['yarn']"),
        ({"architectures": ["LlamaForCausalLM"]}, "not an EAGLE-3 drafter"),
    ],
)
def test_an_export_computing_otherwise_than_our_drafter_is_refused_by_name(
    tmp_path: Path, extra: dict[str, Any], fragment: str
) -> None:
    drafter = small_drafter()
    with pytest.raises(ExportedDrafterError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_exported(specforge_layout(drafter, tmp_path / "bad", **extra), drafter.embed_table)


def test_aux_layer_ids_are_read_as_vllm_reads_them_and_where_sglang_differs_it_is_said() -> None:
    """vLLM 0.32's model runner takes the top-level ids, else eagle_config's, unchanged either way (layer inputs);
    SGLang reads eagle_config's as layer outputs."""
    ours = {
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
    }
    assert aux_layer_ids(ours) == [1, 3, 4] and sglang_differs(ours) is None  # both servers read layers 1, 3, 4
    assert aux_layer_ids({"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}) == [1, 3, 4]  # layer inputs
    inner_only = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}
    assert aux_layer_ids(inner_only) == [0, 2, 3]  # inputs too, for vLLM
    assert "SGLang captures the outputs of layers [1, 3, 4], vLLM those of [0, 2, 3]" in (
        sglang_differs(inner_only) or ""
    )
    layered = {"speculators_model_type": "eagle3", "transformer_layer_config": inner_only}
    assert aux_layer_ids(layered) == [0, 2, 3]  # speculators: the layer config is vLLM's hf_config
    assert aux_layer_ids({}) is None and sglang_differs({}) is None


def test_eval_of_an_export_with_aux_ids_only_in_eagle_config_captures_vllms_layers_and_says_sglangs_differ(
    run: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _out, exported, corpus = run
    inner_only = tmp_path / "inner-only"
    shutil.copytree(exported, inner_only)
    config = json.loads((inner_only / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]  # eagle_config's [1, 3, 4] stay: SGLang's layer outputs
    (inner_only / "config.json").write_text(json.dumps(config))
    assert main(["--export", str(inner_only), "--target", "tiny", "--data", str(corpus), "--k", "3",
                 "--conversations", "1", "--max-new-tokens", "8", "--json"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    assert json.loads(captured.out)["target_layers"] == [0, 2, 3]  # vLLM's inputs 1, 3, 4
    noted = [ln for ln in captured.err.splitlines() if "SGLang captures the outputs of layers" in ln]
    assert len(noted) == 1 and "eagle_config.eagle_aux_hidden_state_layer_ids [1, 3, 4]" in noted[0]


def test_a_speculators_export_without_norm_before_residual_is_refused_as_vllm_defaults_it_true(
    run: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    out, _exported, _corpus = run
    served = export.export_checkpoint(out, tmp_path / "spec", fmt="speculators", record=False).out_dir
    config = json.loads((served / "config.json").read_text())
    del config["norm_before_residual"]
    (served / "config.json").write_text(json.dumps(config))
    embed = load_target("tiny", torch.device("cpu"), tokenizer=load_tokenizer("tiny"), layer_ids=None, seed=0,
                        dtype=torch.float32).embed_weight()  # fmt: skip
    with pytest.raises(ExportedDrafterError, match="norm_before_residual is set"):
        load_exported(served, embed)
    config["norm_before_residual"] = False
    (served / "config.json").write_text(json.dumps(config))
    assert load_exported(served, embed).layer_ids == [1, 3, 4]


def test_eval_of_an_unreadable_export_exits_2_with_one_line(tmp_path: Path) -> None:
    bad = specforge_layout(small_drafter(), tmp_path / "bad", norm_before_residual=True)
    done = subprocess.run(
        [sys.executable, "-m", "engine.trainer", "eval", "--export", str(bad), "--target", "tiny"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if not ln.startswith("eval: ")]
    assert len(lines) == 1 and "norm_before_residual is set" in lines[0], done.stderr


def test_eval_on_every_turn_counts_more_prompts_of_the_same_conversations_and_says_so(
    run: tuple[Path, Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--turns all``: the same held-out conversations, each reply a prompt; the report names the turns; with
    ``--prompt-ids`` (already prompts) it is refused, exit 2."""
    out, _exported, _corpus = run
    last = _eval("--checkpoint", str(out), capsys=capsys)
    every = _eval("--checkpoint", str(out), "--turns", "all", capsys=capsys)
    assert last["turns"] == "last" and every["turns"] == "all"
    assert every["drafters"]["replicas"]["prompts"] > last["drafters"]["replicas"]["prompts"] == 3
    assert every["drafters"]["replicas"]["rounds"] > last["drafters"]["replicas"]["rounds"]
    ids = out.parent / "ids.json"
    ids.write_text("[[1, 2, 3]]")
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint", str(out), "--prompt-ids", str(ids), "--turns", "all"])
    assert exc.value.code == 2
    assert "--turns all: picks turns of the held-out conversations, not of --prompt-ids" in capsys.readouterr().err
