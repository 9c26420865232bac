"""Every target family trains right: a tiny random model of each (tests/support/families.py), through the engine.

Per family (Llama-3.1, Llama-4 Scout, Qwen2.5, Qwen3, Qwen3-MoE, Qwen3-Next, Gemma-3, gpt-oss, Phi-4, Mistral,
DeepSeek-V3, GLM-4.5), on the CPU in float32:

* 10 steps of the real engine (``TrainingRun``) train the drafter, the target loaded from the saved directory;
* the captured states are the inputs of the text decoder's layers 2, L/2 and L-3, where vLLM and SGLang capture
  them (a multimodal wrapper's language model), compared with Hugging Face's ``output_hidden_states``;
* packed rows equal unpacked ones: the target's hidden states and logits to 1e-5 absolute, the drafter's per-step
  summed losses to 1e-5 relative and its gradients to 1e-4 relative or 1e-6 absolute (sums over other batch shapes
  reduce in another order; gpt-oss's eager attention moves a 4e-7 gradient by 1.5e-7); or packing is refused
  before the weights load with one line naming the attention kind;
* the export of the trained checkpoint reads back as trained (aux ids, sizes, flags) and gives its logits;
* τ evaluates (``specdec-train eval`` on the trained checkpoint).

The families' models and their 10-step runs are built once a session (tests/conftest.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.families import FAMILIES, HIDDEN, LAYERS, TRAIN_DRAFT_VOCAB, TRAIN_STEPS, train_config
from support.packed_drafter import drafter_losses as packed_drafter_losses

from engine.trainer import checkpoint as ckpt
from engine.trainer.__main__ import main as train_main
from engine.trainer.data.packing import pack_rows
from engine.trainer.draft.model import DraftConfig, Drafter
from engine.trainer.serve import export
from engine.trainer.serve.evaluate import load_drafter
from engine.trainer.serve.evaluate import main as eval_main
from engine.trainer.verifier.model import FrozenTarget, decoder_layers, load_target, load_tokenizer

NAMES = list(FAMILIES)
PACKED = [n for n in NAMES if FAMILIES[n].packing is None]
REFUSED = [n for n in NAMES if FAMILIES[n].packing is not None]
SERVED_INPUTS = [2, LAYERS // 2, LAYERS - 3]  # vLLM's and SGLang's default aux layers: inputs of these
LENGTHS = [37, 20, 50, 13]  # packed two a row: [37, 20] and [50, 13]; longer than every window and chunk
PLACES = [(0, 0, 0), (1, 0, 37), (2, 1, 0), (3, 1, 50)]  # (unpacked row, packed row, offset in it)
ROW, TTT_STEPS, DRAFT_VOCAB = 64, 3, 64

TargetOf = Callable[[str], FrozenTarget]


@pytest.fixture(scope="module")
def target_of(family_dir: Callable[[str], Path]) -> TargetOf:
    loaded: dict[str, FrozenTarget] = {}

    def get(name: str) -> FrozenTarget:
        if name not in loaded:
            path = str(family_dir(name))
            loaded[name] = load_target(
                path, torch.device("cpu"), tokenizer=load_tokenizer(path), layer_ids=None, seed=0, dtype=torch.float32
            )
        return loaded[name]

    return get


def conversations() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 250, (n,), generator=g) for n in LENGTHS]


def unpacked_and_packed() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    convs = [(ids, (torch.arange(len(ids)) % 4 != 1).float()) for ids in conversations()]
    return pack_rows([[c] for c in convs], ROW, 0), pack_rows([convs[:2], convs[2:]], ROW, 0)


# --- training --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_ten_engine_steps_train_the_drafter_on_the_saved_target(name: str, trained_family: Any) -> None:
    out, steps = trained_family(name)
    assert [e["step"] for e in steps] == list(range(1, TRAIN_STEPS + 1))
    assert all(math.isfinite(v) for e in steps for v in e["loss"])
    assert steps[0]["loss_total"] > 0  # positions were trained: the target's argmax is in the draft vocabulary
    meta = ckpt.read_meta(ckpt.resolve_checkpoint(out)[0])
    assert meta["step"] == TRAIN_STEPS and meta["draft_config"]["hidden_size"] == HIDDEN
    assert meta["target_layers"] == [i - 1 for i in SERVED_INPUTS]  # outputs of 1, L/2-1, L-4


@pytest.mark.parametrize("name", NAMES)
def test_captured_states_are_the_text_decoders_inputs_where_vllm_and_sglang_take_them(
    name: str, target_of: TargetOf
) -> None:
    target = target_of(name)
    model: Any = target.model
    assert len(decoder_layers(model)) == LAYERS == target.config.num_hidden_layers  # the text decoder's layers
    ids = conversations()[0][None]
    _, hidden3 = target.logits_and_hidden3(ids)
    with torch.no_grad():
        states = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states  # [j]: input of j
    torch.testing.assert_close(hidden3, torch.cat([states[j] for j in SERVED_INPUTS], dim=-1), rtol=0, atol=0)


# --- packing ---------------------------------------------------------------------------------------------------
def drafter_losses(
    target: FrozenTarget, drafter: Drafter, batch: tuple[torch.Tensor, ...], packed: bool
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    loss, _, counts, grads = packed_drafter_losses(
        target, drafter, batch, packed, ttt_steps=TTT_STEPS, draft_vocab=DRAFT_VOCAB
    )
    return loss, counts, grads


@pytest.mark.parametrize("name", PACKED)
def test_packed_rows_train_what_the_conversations_train_alone(name: str, target_of: TargetOf) -> None:
    target = target_of(name)
    unpacked, packed = unpacked_and_packed()
    (ids_u, _, _), (ids_p, _, docs_p) = unpacked, packed
    logits_u, hidden_u = target.logits_and_hidden3(ids_u)
    logits_p, hidden_p = target.logits_and_hidden3(ids_p, documents=docs_p)
    for (ru, rp, at), n in zip(PLACES, LENGTHS, strict=True):
        torch.testing.assert_close(hidden_p[rp, at : at + n], hidden_u[ru, :n], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits_p[rp, at : at + n], logits_u[ru, :n], rtol=0, atol=1e-5)
    torch.manual_seed(1)
    drafter = Drafter(
        DraftConfig.from_target(target.config, DRAFT_VOCAB), target.embed_weight(), torch.arange(DRAFT_VOCAB)
    )
    loss_u, counts_u, grads_u = drafter_losses(target, drafter, unpacked, packed=False)
    loss_p, counts_p, grads_p = drafter_losses(target, drafter, packed, packed=True)
    assert counts_u.tolist() == counts_p.tolist() and counts_u.min() > 0
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=0)
    for gu, gp in zip(grads_u, grads_p, strict=True):
        torch.testing.assert_close(gp, gu, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", REFUSED)
def test_packing_is_refused_before_the_target_loads_with_one_line_naming_the_kind(
    name: str, family_dir: Callable[[str], Path], tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    config = train_config(family_dir(name), Path("shipped"), tmp_path / "out", packing=True)  # the shipped corpus
    capfd.readouterr()  # what building the family printed
    args = [f"{key}={json.dumps(value)}" for key, value in config.items()]
    code = train_main([word for arg in args for word in ("--set", arg)])
    err = capfd.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0 and err.startswith("specdec-train: config error: packing: ")
    assert FAMILIES[name].packing in err  # the attention kind, e.g. linear_attention


# --- export and τ ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_the_trained_export_reads_back_as_trained_and_gives_its_logits(
    name: str, trained_family: Any, target_of: TargetOf, tmp_path: Path
) -> None:
    out, _ = trained_family(name)
    checkpoint, _ = ckpt.resolve_checkpoint(out)
    target = target_of(name)
    trained = load_drafter(checkpoint, "replicas", target, torch.device("cpu"))
    ids = conversations()[0][None]
    _, hidden3 = target.logits_and_hidden3(ids)
    for fmt in export.FORMATS:
        served = export.export_checkpoint(checkpoint, tmp_path / fmt, fmt=fmt, record=False).out_dir
        config = json.loads((served / "config.json").read_text())
        settings = export.served_settings(config)
        assert settings["eagle_aux_hidden_state_layer_ids"] == SERVED_INPUTS
        assert settings["draft_vocab_size"] == TRAIN_DRAFT_VOCAB
        assert settings["target_hidden_size"] == target.hidden_size == HIDDEN
        assert not any(settings[flag] for flag in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"))
        loaded = export.drafter_from_export(served, target.embed_weight())
        ours = export.drafter_logits(loaded, hidden3, ids, ttt_steps=2)
        theirs = export.drafter_logits(trained, hidden3, ids, ttt_steps=2)
        assert (ours - theirs).abs().max().item() < 0.05 * theirs.abs().max().item()  # bfloat16 storage
    verifier = config["speculators_config"]["verifier"]  # the speculators layout names the target as served
    assert verifier["architectures"] == [FAMILIES[name].architecture], verifier
    eagle3 = json.loads((tmp_path / "eagle3" / "config.json").read_text())
    assert eagle3["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in SERVED_INPUTS]  # SGLang's


@pytest.mark.parametrize("name", NAMES)
def test_tau_evaluates_the_trained_drafter(name: str, trained_family: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = trained_family(name)
    args = ["--checkpoint", str(out), "--json", "--conversations", "2", "--max-new-tokens", "12", "--k", "3"]
    assert eval_main(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["drafters"]["replicas"]
    assert result["prompts"] == 2 and result["rounds"] > 0
    assert 1.0 <= result["tau"] <= 4.0
