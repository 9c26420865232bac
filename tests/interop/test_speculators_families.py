"""Every target family's trained export loads in the PyPI ``speculators`` package (vLLM's EAGLE-3 library): its own
Eagle3DraftModel reads the speculators layout, takes the embedding from the family's directory (the verifier the export
names: a multimodal wrapper's language model included), reads every served field as written, and gives our drafter's
logits on the family's captured states, at TTT steps 0 and 1. One subprocess for all twelve. Slow (the cached
private venv of test_speculators_loader.py); skipped only when the package registry is unreachable."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from speculators_venv import RegistryUnreachable, ensure_venv
from support.families import FAMILIES, LAYERS

from engine.trainer import checkpoint as ckpt
from engine.trainer.serve import export
from engine.trainer.verifier.model import load_target

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
MAX_ABS_DIFF = 1e-4  # float32 on both sides from the same bf16 weights: only op order differs
SERVED = {
    "target_hidden_size": 64,
    "eagle_aux_hidden_state_layer_ids": [2, LAYERS // 2, LAYERS - 3],
    "norm_before_residual": False,
    "norm_before_fc": False,
    "fc_norm": False,
    "norm_output": False,
}


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run builds the venv (pip, ~2 min on 2 cores)
def test_speculators_loads_every_familys_export_and_gives_our_logits(
    tmp_path: Path, trained_family: Any, family_dir: Any
) -> None:
    try:
        python = ensure_venv()
    except RegistryUnreachable as exc:
        pytest.skip(f"the package registry is unreachable, so speculators cannot be installed: {exc}")
    args: list[str] = []
    for name in FAMILIES:
        out, _ = trained_family(name)
        served = export.export_checkpoint(ckpt.resolve_checkpoint(out)[0], tmp_path / name, fmt="speculators").out_dir
        target = load_target(
            str(family_dir(name)), torch.device("cpu"), tokenizer=None, layer_ids=None, seed=0, dtype=torch.float32
        )
        ids = torch.randint(3, 250, (1, 24), generator=torch.Generator().manual_seed(3))
        _, hidden3 = target.logits_and_hidden3(ids)
        inputs = tmp_path / f"{name}.pt"
        torch.save({"hidden3": hidden3, "input_ids": ids, "embed": target.embed_weight().detach()}, inputs)
        args += [str(served), str(inputs)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [str(python), str(HERE / "speculators_forward.py"), *args],
        capture_output=True, text=True, timeout=600, env=env, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(FAMILIES)
    for name, result in zip(FAMILIES, results, strict=True):
        print(f"{name}: speculators vs ours {result['max_abs_diff']:.2e} / step 1 {result['step1_max_abs_diff']:.2e}")
        assert result["loader"] == "speculators.models.eagle3.core.Eagle3DraftModel", name
        assert result["d2t_equal"] and result["t2d_equal"] and result["embed_from_verifier_equal"], (name, result)
        assert result["max_abs_diff"] < MAX_ABS_DIFF and result["step1_max_abs_diff"] < MAX_ABS_DIFF, (name, result)
        assert result["argmax_agreement"] == 1.0, (name, result)
        assert {k: result["config"][k] for k in SERVED} == SERVED, (name, result["config"])
