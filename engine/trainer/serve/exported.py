"""An exported EAGLE-3 drafter read back as a server reads it, whichever trainer wrote it.

``specdec-train eval --export DIR`` measures τ of the directory vLLM serves, not of a float32 checkpoint: ours
(``specdec-train export``, either layout) or another trainer's ``LlamaForCausalLMEagle3`` directory (SpecForge's
``export_to_sglang``: the same weight names, ``d2t``/``t2d``, ``config.json`` written by transformers with
``rope_parameters``, often no ``head_dim`` and no aux layer ids). The config is read the way vLLM's
``llama_eagle3.py`` reads it, and anything our drafter cannot compute the same way is refused by name
(``ExportedDrafterError``, one line) rather than evaluated wrongly: ``norm_before_residual``, ``norm_before_fc``,
``fc_norm`` or ``norm_output`` set, more than one layer, a target hidden size unlike the drafter's, rope scaling.
An absent flag is read with vLLM's default for the layout (export.served_flags): false, except
``norm_before_residual`` in the speculators layout (``speculators_model_type``), which vLLM takes as true.

The aux layers (the target layers whose OUTPUTS the drafter reads, as evaluate.py and our checkpoints count them)
are the ones vLLM 0.32 captures, which ``--count vllm`` promises to equal (export.vllm_aux_layer_ids): the top-level
``eagle_aux_hidden_state_layer_ids``, else ``eagle_config``'s, either way layer INPUT ids (output of ``id - 1``);
neither: None, the servers' default (outputs of 1, L/2-1, L-4). SGLang reads ``eagle_config``'s as OUTPUT ids, so
where they differ from vLLM's layers ``sglang_differs`` says so in one line (evaluate.py logs it).

``as_exported``: a checkpoint's weights rounded exactly as ``export.served_tensors`` writes them (bfloat16), so
``eval --checkpoint`` counts what the served export accepts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.trainer.draft.model import DraftConfig, Drafter
from engine.trainer.serve.export import (
    EXPORT_DTYPE,
    ExportError,
    our_name,
    served_flags,
    sglang_aux_layer_ids,
    vllm_aux_layer_ids,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"


class ExportedDrafterError(ValueError):
    """An export this evaluation cannot read, or would compute differently from a server; the message is one line."""


@dataclass(frozen=True)
class ExportedDrafter:
    drafter: Drafter
    layer_ids: list[int] | None  # target layers whose outputs it reads; None: the servers' default
    config: dict[str, Any]


def as_exported(state: dict[str, Any]) -> dict[str, Any]:
    """Floating tensors through the export's dtype and back (``export.served_tensors``), the rest as they are."""
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and name not in ("d2t", "t2d"):
            out[name] = value.detach().to(EXPORT_DTYPE).to(value.dtype)
        else:
            out[name] = value
    return out


def read_config(out_dir: Path) -> dict[str, Any]:
    path = Path(out_dir) / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportedDrafterError(f"{path} does not exist: not an exported drafter directory") from None
    except (OSError, ValueError) as exc:
        raise ExportedDrafterError(f"cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ExportedDrafterError(f"{path} is not a JSON object")
    return config


def _layer(config: dict[str, Any]) -> dict[str, Any]:
    """The decoder layer's settings: speculators nests them, the EAGLE-3 layout keeps them at the top."""
    if config.get("speculators_model_type") == "eagle3":
        layer = config.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ExportedDrafterError("speculators config without transformer_layer_config")
        return layer
    if ARCHITECTURE not in (config.get("architectures") or []):
        raise ExportedDrafterError(
            f"architectures {config.get('architectures')!r}: not an EAGLE-3 drafter ({ARCHITECTURE} or speculators)"
        )
    return config


def _rope_theta(layer: dict[str, Any]) -> float:
    raw = layer.get("rope_parameters")
    params: dict[str, Any] = raw if isinstance(raw, dict) else {}
    scaling = layer.get("rope_scaling")
    kinds = {str(x.get("rope_type", x.get("type", "default"))) for x in (params, scaling) if isinstance(x, dict) and x}
    if kinds - {"default"}:
        raise ExportedDrafterError(f"rope scaling {sorted(kinds - {'default'})}: this evaluation has plain rope only")
    theta = layer.get("rope_theta")
    return float(theta if theta is not None else params.get("rope_theta", 10000.0))


def _refuse_unlike_ours(config: dict[str, Any], layer: dict[str, Any]) -> None:
    """Settings that make vLLM compute another function than our Drafter does: refused by name."""
    flags = served_flags(config)  # absent: vLLM's default for the layout
    for key in ("norm_before_residual", "norm_before_fc", "fc_norm"):
        if flags[key]:
            raise ExportedDrafterError(f"{key} is set: our drafter has no such norm, so its τ would not be vLLM's")
    if flags["norm_output"]:  # vLLM's llama_eagle3: the next step reads the post-norm states, ours pre-norm
        raise ExportedDrafterError("norm_output is set: vLLM would feed each step the normed output, ours the pre-norm")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ExportedDrafterError(f"num_hidden_layers {layer.get('num_hidden_layers')}: EAGLE-3 drafters have one")
    target_hidden = config.get("target_hidden_size", layer.get("hidden_size"))
    if target_hidden is not None and int(target_hidden) != int(layer["hidden_size"]):
        hidden = layer["hidden_size"]
        raise ExportedDrafterError(f"target_hidden_size {target_hidden} differs from hidden_size {hidden}")


def aux_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """The target layers (output ids) whose states vLLM hands the drafter, as the module docstring says; None: the
    default."""
    inputs = vllm_aux_layer_ids(config)
    return [i - 1 for i in inputs] if inputs else None


def sglang_differs(config: dict[str, Any]) -> str | None:
    """One line when SGLang would capture other target layers than vLLM for this export (it reads
    ``eagle_config``'s ids as layer outputs), else None."""
    sglang = sglang_aux_layer_ids(config)
    if not sglang:
        return None
    vllm = aux_layer_ids(config)
    if vllm == sglang:
        return None
    return (
        f"eagle_config.eagle_aux_hidden_state_layer_ids {sglang}: SGLang captures the outputs of layers {sglang}, "
        f"vLLM those of {vllm if vllm is not None else 'its default layers'}; counted as vLLM serves it"
    )


def draft_config(config: dict[str, Any]) -> DraftConfig:
    layer = _layer(config)
    _refuse_unlike_ours(config, layer)
    try:
        hidden, heads = int(layer["hidden_size"]), int(layer["num_attention_heads"])
        return DraftConfig(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            intermediate_size=int(layer["intermediate_size"]),
            vocab_size=int(layer["vocab_size"]),
            draft_vocab_size=int(config.get("draft_vocab_size") or layer["draft_vocab_size"]),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(layer),
            initializer_range=float(layer.get("initializer_range", 0.02)),
        )
    except KeyError as exc:
        raise ExportedDrafterError(f"config.json lacks {exc.args[0]}") from None


def load_exported(out_dir: Path, embed_weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> ExportedDrafter:
    """Our Drafter computing what vLLM computes from ``out_dir`` (weights in ``dtype``), with the target's
    embedding table; ExportedDrafterError for an export it cannot stand for."""
    from safetensors.torch import load_file

    config = read_config(out_dir)
    dcfg = draft_config(config)
    path = Path(out_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise ExportedDrafterError(f"{path} does not exist")
    try:
        tensors = {our_name(k): v for k, v in load_file(str(path)).items()}
    except ExportError as exc:
        raise ExportedDrafterError(f"{path}: {exc}") from None
    missing = {"d2t", "fc.weight", "lm_head.weight", "norm.weight"} - set(tensors)
    if missing:
        raise ExportedDrafterError(f"{path} lacks {', '.join(sorted(missing))}")
    if tuple(embed_weight.shape) != (dcfg.vocab_size, dcfg.hidden_size):
        raise ExportedDrafterError(
            f"the target's embedding is {tuple(embed_weight.shape)}, the drafter expects "
            f"({dcfg.vocab_size}, {dcfg.hidden_size}): another target's drafter"
        )
    d2t = tensors["d2t"].long()
    drafter = Drafter(dcfg, embed_weight.detach().to(dtype), torch.arange(d2t.numel()) + d2t)
    state = {k: v if k in ("d2t", "t2d") else v.to(dtype) for k, v in tensors.items()}
    if "t2d" not in state:
        t2d = drafter.t2d
        assert isinstance(t2d, torch.Tensor)
        state["t2d"] = t2d
    try:
        drafter.load_state_dict(state)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ExportedDrafterError(f"{path}: the weights do not fit the config: {first}") from None
    return ExportedDrafter(drafter.eval(), aux_layer_ids(config), config)
