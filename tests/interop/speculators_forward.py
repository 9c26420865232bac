"""Run inside the speculators venv: load an export with ``speculators``' own EAGLE-3 class and compare its logits with
our drafter's on the same inputs. Prints one JSON object (max_abs_diff, argmax agreement, what was loaded).

    python speculators_forward.py EXPORT_DIR INPUTS.pt [EXPORT_DIR INPUTS.pt ...]

One JSON line per pair, in order (one interpreter for many exports: torch and speculators import once).

INPUTS.pt holds ``hidden3`` (1, T, 3H, the target's captured layers), ``input_ids`` (1, T) and ``embed`` (V, H),
the target's embedding table. The export stores no embedding: speculators loads it from the verifier directory the
export names, as servers share the target's; we check it got the same table. Both sides compute in float32 from the
exported bfloat16 weights, so the difference is the implementations', not rounding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch


def speculators_logits(export_dir: Path, hidden3: torch.Tensor, input_ids: torch.Tensor) -> tuple[Any, Any]:
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    config = Eagle3SpeculatorConfig.from_pretrained(str(export_dir))
    config.transformer_layer_config._attn_implementation = "eager"  # a dense causal mask: the CPU path
    model = Eagle3DraftModel.from_pretrained(str(export_dir), config=config, torch_dtype=torch.float32).eval()
    # from_pretrained fills embed_tokens from the verifier only while it is still NaN; transformers sometimes
    # initialises that missing weight first (seen with a path containing "model"), so ask for the verifier's.
    model._load_verifier_weights(overwrite_embed_tokens=True)
    logits: list[torch.Tensor] = []
    model.lm_head.register_forward_hook(lambda _m, _i, out: logits.append(out.detach().float()))
    t = input_ids.shape[1]
    # Step 0 of our drafter reads token t + 1 at position t: give speculators the shifted ids, positions 0..T-1.
    shifted = torch.cat((input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])), dim=1)
    with torch.no_grad():
        model(
            hidden_states=hidden3,
            input_ids=shifted,
            document_ids=torch.zeros_like(input_ids),
            position_ids=torch.arange(t).unsqueeze(0),
            ttt_steps=2,
        )
    return torch.stack(logits), model


SERVED_FIELDS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
                 "norm_before_fc", "fc_norm", "norm_output")  # fmt: skip


def main(argv: list[str]) -> int:
    for export_dir, inputs_path in zip(argv[::2], argv[1::2], strict=True):
        print(json.dumps(compare(Path(export_dir), Path(inputs_path))), flush=True)
    return 0


def compare(export_dir: Path, inputs_path: Path) -> dict[str, Any]:
    data: dict[str, Any] = torch.load(inputs_path, weights_only=True)
    hidden3, input_ids, embed = data["hidden3"].float(), data["input_ids"].long(), data["embed"].float()
    theirs, model = speculators_logits(export_dir, hidden3, input_ids)

    from engine.trainer.serve import export

    drafter = export.drafter_from_export(export_dir, embed)
    both_ours = export.drafter_logits(drafter, hidden3, input_ids, ttt_steps=2)
    ours, theirs_all = both_ours[0], theirs
    theirs = theirs_all[0]
    # TTT step 1 (the second proposal): speculators moves the positions on by one per step, as our training does.
    step1 = slice(0, input_ids.shape[1] - 2)
    step1_diff = (both_ours[1][:, step1] - theirs_all[1][:, step1]).abs().max().item()
    _, tensors = export.read_export(export_dir)
    valid = slice(0, input_ids.shape[1] - 1)  # the last position reads the padding token on both sides
    diff = (ours[:, valid] - theirs[:, valid]).abs()
    result = {
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "logit_scale": ours[:, valid].abs().max().item(),
        "argmax_agreement": (ours[:, valid].argmax(-1) == theirs[:, valid].argmax(-1)).float().mean().item(),
        "positions": input_ids.shape[1] - 1,
        "step1_max_abs_diff": step1_diff,
        "d2t_equal": bool(model.d2t is not None and torch.equal(model.d2t, tensors["d2t"])),
        "t2d_equal": bool(model.t2d is not None and torch.equal(model.t2d, tensors["t2d"])),
        "embed_from_verifier_equal": bool(torch.equal(model.embed_tokens.weight.float(), embed)),
        "loader": f"{type(model).__module__}.{type(model).__name__}",
        "config": {name: getattr(model.config, name, "absent") for name in SERVED_FIELDS},  # as speculators read it
    }
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
