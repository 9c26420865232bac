"""An independent loader accepts our export: the PyPI ``speculators`` package (vLLM's EAGLE-3 training library) loads
the ``speculators`` layout with its own Eagle3DraftModel, and its logits match our drafter's on the same target
hidden states. Slow (a cached private venv, ~2 min to build once); skipped only when the package registry is
unreachable."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from speculators_venv import RegistryUnreachable, ensure_venv  # beside this file (pytest puts its dir on sys.path)

from engine.trainer import checkpoint as ckpt
from engine.trainer.draft.model import DraftConfig, Drafter
from engine.trainer.serve import export
from engine.trainer.verifier.model import FrozenTarget
from engine.trainer.verifier.model_configs import tiny_config

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
VOCAB, HIDDEN, LAYERS, DRAFT_VOCAB, TARGET_LAYERS = 96, 32, 4, 40, [1, 2, 3]
MAX_ABS_DIFF = 1e-4  # float32 on both sides from the same bf16 weights: only op order differs


def build_target_and_drafter(target_dir: Path) -> tuple[FrozenTarget, Drafter]:
    from transformers import LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config(VOCAB, HIDDEN, LAYERS))
    model.save_pretrained(target_dir)
    target = FrozenTarget(model, None, TARGET_LAYERS, torch.device("cpu"))
    dcfg = DraftConfig.from_target(model.config, DRAFT_VOCAB)
    draft_to_target = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:DRAFT_VOCAB]).values
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        drafter = Drafter(dcfg, target.embed_weight().detach(), draft_to_target)
        with torch.no_grad():  # norms away from 1: a norm weight in the wrong place changes the logits
            for name, p in drafter.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    return target, drafter


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run builds the venv (pip, ~2 min on 2 cores; more on a busy machine)
def test_speculators_eagle3_model_loads_the_export_and_gives_our_logits(tmp_path: Path) -> None:
    try:
        python = ensure_venv()
    except RegistryUnreachable as exc:
        pytest.skip(f"the package registry is unreachable, so speculators cannot be installed: {exc}")
    target, drafter = build_target_and_drafter(tmp_path / "target")
    meta = {
        "config": {"target": str(tmp_path / "target"), "ttt_steps": 3},
        "draft_config": drafter.cfg.to_dict(),
        "target_layers": TARGET_LAYERS,
    }
    states = {"replicas": {"model": drafter.state_dict()}}
    path = ckpt.save_checkpoint(tmp_path / "out", 5, states, meta, drafter.d2t + torch.arange(DRAFT_VOCAB), keep=1)
    out = export.export_checkpoint(path, tmp_path / "spec", fmt="speculators").out_dir
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str((tmp_path / "target").resolve())

    input_ids = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(3))
    hidden3 = target.run(input_ids, torch.ones(1, 24), drafter.d2t + torch.arange(DRAFT_VOCAB), drafter.t2d).hidden3
    embed = target.embed_weight().detach()
    torch.save({"hidden3": hidden3, "input_ids": input_ids, "embed": embed}, tmp_path / "in.pt")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [str(python), str(HERE / "speculators_forward.py"), str(out), str(tmp_path / "in.pt")],
        capture_output=True, text=True, timeout=300, env=env, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"speculators vs ours: {result}")
    assert result["loader"] == "speculators.models.eagle3.core.Eagle3DraftModel"
    assert result["d2t_equal"] and result["t2d_equal"] and result["embed_from_verifier_equal"]
    assert result["max_abs_diff"] < MAX_ABS_DIFF, result
    # The second proposal too: RoPE positions advance with the TTT step on both sides (0.067 apart without it).
    assert result["step1_max_abs_diff"] < MAX_ABS_DIFF, result
    assert result["argmax_agreement"] == 1.0
