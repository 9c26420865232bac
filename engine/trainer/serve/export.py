"""Export a trained drafter as the EAGLE-3 draft model that vLLM, SGLang and the speculators package load.

    specdec-train export CHECKPOINT_OR_OUTPUT_DIR OUT_DIR [--format eagle3|speculators] [--drafter NAME]

Both layouts are one ``config.json`` and one ``model.safetensors``: bfloat16 weights, ``d2t`` (int64, EAGLE-3's
offsets: target id = draft id + d2t) and ``t2d`` (bool mask over the target vocabulary). No ``embed_tokens``: every
loader shares the target's embedding, as training did.

* ``eagle3`` (the EAGLE-3 / SpecForge layout): ``architectures: ["LlamaForCausalLMEagle3"]``, weights ``midlayer.*``,
  ``fc``, ``norm``, ``lm_head``. vLLM and SGLang serve it with ``speculative_config={"method": "eagle3",
  "model": OUT_DIR}`` / ``--speculative-algorithm EAGLE3 --speculative-draft-model-path OUT_DIR``.
* ``speculators`` (vLLM's speculators layout): ``speculators_model_type: eagle3``, ``transformer_layer_config``,
  ``speculators_config`` (algorithm, proposal method, verifier); weights ``layers.0.*``.

Aux layer ids: a checkpoint's ``target_layers`` are the decoder layers whose OUTPUT the drafter was trained on.
SGLang reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` in that sense (it adds 1 itself); vLLM and
speculators read a top-level ``eagle_aux_hidden_state_layer_ids`` as layer INPUTS (id j = output of layer j-1,
0 = the embedding), so that list is ours + 1. vLLM 0.32 falls back to ``eagle_config``'s list when there is no
top-level one and reads it unchanged, as inputs too: an export with only that list is served one layer apart by the
two servers (ours write both lists, which agree). Rope is exactly the drafter's (``rope_theta``, ``rope_scaling``).

Every field a server reads with a default is written, in both layouts at the top level (vLLM's Eagle3 Llama and its
speculators path read them there, SGLang's llama_eagle3 its sizes): ``draft_vocab_size``, ``target_hidden_size``
(the width of each captured target state: fc reads three of them), ``eagle_aux_hidden_state_layer_ids`` and the
architecture flags of ``ARCHITECTURE_FLAGS``, all false for this drafter: ``norm_before_residual`` (its residual is
fc's output before ``hidden_norm``; absent, vLLM's speculators path assumes true, its LlamaForCausalLMEagle3 layout
false), ``norm_before_fc`` (no norm over the concatenated states before fc), ``fc_norm`` (no per-state norm, EAGLE
3.1) and ``norm_output`` (a step feeds the next its pre-norm output). ``served_settings`` reads them back as vLLM
does, with its default for the layout; ``drafter_from_export`` refuses an export whose flags this drafter cannot
compute.

The output directory appears whole or not at all (written beside it, then renamed); bad input writes nothing.
When the checkpoint belongs to a run, an ``export`` event goes to that run's events.jsonl (``status`` shows it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.protocol import ExportEvent
from engine.trainer import checkpoint as ckpt
from engine.trainer.draft.average import served_weights
from engine.trainer.threads.metrics import EventLog, events_path_for

FORMATS: tuple[str, ...] = ("eagle3", "speculators")
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EXPORT_DTYPE = torch.bfloat16

# Our decoder layer's parameter -> its name inside a served Llama decoder layer (vLLM/SGLang/HF all agree).
LAYER_PARAMS: dict[str, str] = {
    "input_layernorm.weight": "input_layernorm.weight",
    "hidden_norm.weight": "hidden_norm.weight",
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "gate_proj.weight": "mlp.gate_proj.weight",
    "up_proj.weight": "mlp.up_proj.weight",
    "down_proj.weight": "mlp.down_proj.weight",
}
TOP_PARAMS: tuple[str, ...] = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")
LAYER_PREFIX: dict[str, str] = {"eagle3": "midlayer.", "speculators": "layers.0."}
# What this drafter computes, in the flags the servers read with a default (the module docstring says each).
ARCHITECTURE_FLAGS: dict[str, bool] = {
    "norm_before_residual": False,
    "norm_before_fc": False,
    "fc_norm": False,
    "norm_output": False,
}
# The value vLLM assumes for a flag the config leaves out, by layout: its LlamaForCausalLMEagle3 layout reads them
# with getattr(config, flag, False) (llama_eagle3.py); its speculators path (speculators_model_type set) sets
# norm_before_residual true when absent (transformers_utils/configs/speculators/algos.py, update_eagle3).
SERVER_DEFAULTS: dict[str, bool] = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
                                    "norm_output": False}  # fmt: skip
SPECULATORS_DEFAULTS: dict[str, bool] = {**SERVER_DEFAULTS, "norm_before_residual": True}
AUX_IDS = "eagle_aux_hidden_state_layer_ids"


class ExportError(Exception):
    """Input that cannot be exported; the message is one line a person can act on."""


@dataclass
class ExportResult:
    out_dir: Path
    checkpoint: Path
    step: int
    drafter: str
    fmt: str
    params: int
    size_bytes: int
    picked: str | None = None  # how the checkpoint was chosen, when the input was an output directory
    events_path: Path | None = None
    notes: list[str] = field(default_factory=list)
    weights: str = "trained"  # or the moving average's words (ema_decay; draft/average.py served_weights)


def choose_drafter(meta: dict[str, Any], name: str | None) -> str:
    drafters = [str(d) for d in meta.get("drafters") or []]
    if not drafters:
        raise ExportError("the checkpoint lists no drafter states")
    if name is not None:
        if name not in drafters:
            raise ExportError(f"no drafter {name!r} in the checkpoint; it has: {', '.join(drafters)}")
        return name
    if len(drafters) > 1:
        choices = ", ".join(drafters)
        raise ExportError(f"the checkpoint has {len(drafters)} drafters; choose one with --drafter: {choices}")
    return drafters[0]


def _read_meta(checkpoint: Path) -> dict[str, Any]:
    try:
        meta = ckpt.read_meta(checkpoint)
    except (OSError, ValueError) as exc:
        raise ExportError(f"cannot read {checkpoint / ckpt.META}: {exc}") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("draft_config"), dict):
        raise ExportError(f"{checkpoint / ckpt.META} has no draft_config: not a drafter checkpoint of this trainer")
    if not isinstance(meta.get("target_layers"), list) or len(meta["target_layers"]) != 3:
        raise ExportError(f"{checkpoint / ckpt.META} has no target_layers (three layer ids)")
    return meta


def _load_model_state(
    checkpoint: Path, drafter: str, *, trained_weights: bool = False
) -> tuple[dict[str, torch.Tensor], str]:
    """(the weights a drafter state serves, which they are): the moving average where the run kept one
    (ema_decay), unless ``trained_weights``."""
    try:
        state = ckpt.load_drafter_state(checkpoint, drafter)
    except FileNotFoundError as exc:
        raise ExportError(
            f"{checkpoint / (drafter + '.pt')} is missing (the engine may have rotated this checkpoint out while it "
            "was read; export again)"
        ) from exc
    except Exception as exc:  # torch.load raises many types for a damaged file; each is this one error to the user
        raise ExportError(f"cannot load {checkpoint / (drafter + '.pt')}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(state, dict):
        raise ExportError(f"{checkpoint / (drafter + '.pt')} has no model state")
    try:  # served_weights checks the model state and the average against it
        model, which = served_weights(state, trained=trained_weights)
    except ValueError as exc:
        raise ExportError(f"{checkpoint / (drafter + '.pt')}: {exc}") from exc
    return {str(k): v for k, v in model.items() if isinstance(v, torch.Tensor)}, which


# --- names, shapes and config -------------------------------------------------------------------------------------
def served_name(name: str, fmt: str) -> str:
    """Our state-dict key -> the key the serving loaders read."""
    if name in TOP_PARAMS:
        return name
    if name.startswith("layer."):
        inner = LAYER_PARAMS.get(name[len("layer.") :])
        if inner is not None:
            return LAYER_PREFIX[fmt] + inner
    raise ExportError(f"drafter parameter {name!r} has no EAGLE-3 serving name (a model change the exporter lacks)")


def our_name(served: str) -> str:
    """The inverse of ``served_name`` (either layout)."""
    if served in TOP_PARAMS:
        return served
    for prefix in LAYER_PREFIX.values():
        if served.startswith(prefix):
            inner = served[len(prefix) :]
            for ours, theirs in LAYER_PARAMS.items():
                if theirs == inner:
                    return "layer." + ours
    raise ExportError(f"{served!r} is not an EAGLE-3 drafter weight name")


def aux_layer_ids(target_layers: list[int]) -> dict[str, list[int]]:
    """Captured layer OUTPUT ids (ours, SGLang's) and the same layers as INPUT ids (vLLM's, speculators')."""
    outputs = [int(i) for i in target_layers]
    return {"outputs": outputs, "inputs": [i + 1 for i in outputs]}


def rope_settings(draft_cfg: dict[str, Any]) -> dict[str, Any]:
    """The drafter's rope as trained, in both the legacy keys (rope_theta/rope_scaling) and transformers 5's."""
    theta = float(draft_cfg.get("rope_theta", 10000.0))
    scaling = draft_cfg.get("rope_scaling")
    if scaling is not None and not isinstance(scaling, dict):
        raise ExportError(f"draft_config rope_scaling is {scaling!r}, not a mapping")
    params: dict[str, Any] = {"rope_type": "default"}
    if scaling:
        params = {k: v for k, v in scaling.items() if k != "type"}
        params["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    params["rope_theta"] = theta
    return {"rope_theta": theta, "rope_scaling": dict(scaling) if scaling else None, "rope_parameters": params}


def target_hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """What the checkpoint says of the target's Hugging Face config (for max positions and the verifier)."""
    recorded = meta.get("target_hf_config")
    if isinstance(recorded, dict):
        return recorded
    cfg = meta.get("config") or {}
    spec = str(cfg.get("target", ""))
    local = Path(spec).expanduser() / CONFIG_FILE
    if spec and local.is_file():
        try:
            data = json.loads(local.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}
    from engine.trainer.verifier.model_configs import llama3_8b_config, tiny_config

    if spec == "tiny":
        vocab = int(meta["draft_config"]["vocab_size"])
        built: dict[str, Any] = tiny_config(
            vocab, int(cfg.get("tiny_hidden", 64)), int(cfg.get("tiny_layers", 4))
        ).to_dict()
        return built
    if spec == "llama3-8b-shape":
        built = llama3_8b_config().to_dict()
        return built
    return {}


def target_hidden_size(meta: dict[str, Any]) -> int:
    """The width of one captured target state: the target's (text decoder's) hidden size as recorded, else the
    drafter's, which training sets equal to it (fc maps 3 x this to the drafter's hidden size)."""
    target = target_hf_config(meta)
    text = target.get("text_config") if isinstance(target.get("text_config"), dict) else target
    size = text.get("hidden_size") if isinstance(text, dict) else None
    return int(size) if isinstance(size, int) and size > 0 else int(meta["draft_config"]["hidden_size"])


def server_defaults(config: dict[str, Any]) -> dict[str, bool]:
    """The flags' defaults vLLM applies to this export's layout (SERVER_DEFAULTS or SPECULATORS_DEFAULTS)."""
    return SPECULATORS_DEFAULTS if "speculators_model_type" in config else SERVER_DEFAULTS


def served_flags(config: dict[str, Any]) -> dict[str, bool]:
    """The architecture flags as vLLM reads them: from the top level in either layout (its speculators path sets
    them over ``transformer_layer_config``'s), the layout's default where absent."""
    return {flag: bool(config.get(flag, default)) for flag, default in server_defaults(config).items()}


def vllm_aux_layer_ids(config: dict[str, Any]) -> list[int]:
    """The aux layer ids vLLM 0.32 captures, as LAYER INPUT ids (``[]``: its default). Its model runner
    (``_get_eagle3_aux_layers_from_config``) reads the draft config's top-level ``eagle_aux_hidden_state_layer_ids``,
    else ``eagle_config``'s, unchanged either way; the speculators path builds that config from
    ``transformer_layer_config`` plus the top-level ids."""
    hf = config.get("transformer_layer_config", config) if "speculators_model_type" in config else config
    hf = hf if isinstance(hf, dict) else {}
    ids = config.get(AUX_IDS) or hf.get(AUX_IDS)
    eagle = hf.get("eagle_config")
    if not ids and isinstance(eagle, dict):
        ids = eagle.get(AUX_IDS)
    return [int(i) for i in ids] if isinstance(ids, list) else []


def sglang_aux_layer_ids(config: dict[str, Any]) -> list[int]:
    """``eagle_config.eagle_aux_hidden_state_layer_ids`` as SGLang reads them: layer OUTPUT ids (it captures the
    input of id + 1); ``[]``: none, its default."""
    eagle = config.get("eagle_config")
    ids = eagle.get(AUX_IDS) if isinstance(eagle, dict) else None
    return [int(i) for i in ids] if isinstance(ids, list) else []


def served_settings(config: dict[str, Any]) -> dict[str, Any]:
    """What a server reads from an export's config.json, with the server's default for an absent key: the sizes,
    the aux layer ids (vLLM's layer inputs; SGLang's outputs in ``eagle_config``) and the architecture flags."""
    layer = config.get("transformer_layer_config", config)
    return {
        "draft_vocab_size": int(config["draft_vocab_size"]),
        "target_hidden_size": int(config.get("target_hidden_size") or layer["hidden_size"]),
        AUX_IDS: vllm_aux_layer_ids(config),
        "sglang_aux_hidden_state_layer_ids": sglang_aux_layer_ids(config),
        **served_flags(config),
    }


def served_architectures(meta: dict[str, Any]) -> list[str] | None:
    """The architectures in the target directory's own config.json: what a server loads as the verifier (a
    multimodal wrapper's, where the checkpoint records only its text decoder's config); None without one."""
    local = Path(str((meta.get("config") or {}).get("target", ""))).expanduser() / CONFIG_FILE
    try:
        found = json.loads(local.read_text(encoding="utf-8")).get("architectures") if local.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return [str(a) for a in found] if isinstance(found, list) and found else None


def default_verifier(meta: dict[str, Any]) -> str | None:
    """The target as a loader can find it: its absolute directory; None for a built-in random preset."""
    spec = str((meta.get("config") or {}).get("target", ""))
    path = Path(spec).expanduser()
    if spec and path.is_dir():
        return str(path.resolve())
    return None


def _layer_config(meta: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    d = meta["draft_config"]
    return {
        "model_type": "llama",
        "vocab_size": int(d["vocab_size"]),
        "hidden_size": int(d["hidden_size"]),
        "intermediate_size": int(d["intermediate_size"]),
        "num_hidden_layers": 1,
        "num_attention_heads": int(d["num_heads"]),
        "num_key_value_heads": int(d["num_kv_heads"]),
        "head_dim": int(d["head_dim"]),
        "hidden_act": "silu",
        "rms_norm_eps": float(d["rms_norm_eps"]),
        "initializer_range": float(d.get("initializer_range", 0.02)),  # how the drafter was initialised
        "max_position_embeddings": int(target.get("max_position_embeddings") or 2048),
        **rope_settings(d),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,  # SGLang would reuse the embedding as lm_head otherwise
        "torch_dtype": "bfloat16",
    }


def build_config(meta: dict[str, Any], fmt: str, *, verifier: str | None, provenance: dict[str, Any]) -> dict[str, Any]:
    d = meta["draft_config"]
    target = target_hf_config(meta)
    layer = _layer_config(meta, target)
    aux = aux_layer_ids(meta["target_layers"])
    common = {
        "draft_vocab_size": int(d["draft_vocab_size"]),
        "target_hidden_size": target_hidden_size(meta),
        **ARCHITECTURE_FLAGS,
        "eagle_aux_hidden_state_layer_ids": aux["inputs"],  # vLLM / speculators: layer-input ids
    }
    if fmt == "eagle3":
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            **layer,
            **common,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux["outputs"], "use_aux_hidden_state": True},
            "specdec_export": provenance,
        }
    ttt_steps = int((meta.get("config") or {}).get("ttt_steps", 3))
    architectures = served_architectures(meta) or target.get("architectures") or ["LlamaForCausalLM"]
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        **common,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": ttt_steps,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(architectures)},
        },
        "torch_dtype": "bfloat16",
        "specdec_export": provenance,
    }


def served_tensors(state: dict[str, torch.Tensor], meta: dict[str, Any], fmt: str) -> dict[str, torch.Tensor]:
    """The drafter's weights under the served names, floats in bfloat16, checked against draft_config."""
    d = meta["draft_config"]
    h, vocab, draft_vocab = int(d["hidden_size"]), int(d["vocab_size"]), int(d["draft_vocab_size"])
    missing = [n for n in (*TOP_PARAMS, *(f"layer.{k}" for k in LAYER_PARAMS)) if n not in state]
    if missing:
        raise ExportError(f"the drafter state lacks {', '.join(missing)}")
    expect = {
        "fc.weight": (h, 3 * h),
        "lm_head.weight": (draft_vocab, h),
        "norm.weight": (h,),
        "d2t": (draft_vocab,),
        "t2d": (vocab,),
    }
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name in expect and tuple(tensor.shape) != expect[name]:
            raise ExportError(f"{name} has shape {tuple(tensor.shape)}, draft_config says {expect[name]}")
        served = served_name(name, fmt)
        if name == "d2t":
            target_ids = torch.arange(draft_vocab) + tensor.long()
            if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
                raise ExportError(f"d2t maps draft ids outside the target vocabulary (size {vocab})")
            out[served] = tensor.to(torch.int64).contiguous()
        elif name == "t2d":
            out[served] = tensor.to(torch.bool).contiguous()
        else:
            out[served] = tensor.detach().to(EXPORT_DTYPE).contiguous()
    return out


# --- writing ------------------------------------------------------------------------------------------------------
def _check_out_dir(out_dir: Path) -> None:
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise ExportError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise ExportError(f"{out_dir} exists and is not empty; choose a new directory")


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it, racing other threads) where Linux says it."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_atomically(out_dir: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    from safetensors.torch import save_file

    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as exc:  # a file on the way, a read-only or vanished parent
        where = f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)
        raise ExportError(f"{out_dir}: cannot write an export there ({where})") from None
    try:
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        # safetensors creates the file 0600; an export is read by a server that may run as another user, so it
        # gets a normal file's mode (0666 less the umask, as config.json beside it).
        os.chmod(tmp / WEIGHTS_FILE, 0o666 & ~_umask())
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=False) + "\n", encoding="utf-8")
        size = sum(p.stat().st_size for p in tmp.iterdir())
        if out_dir.is_dir():
            out_dir.rmdir()  # empty (checked above): rename cannot replace a directory that has entries
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size


# --- recording the export in the run's events -----------------------------------------------------------------------
def run_events_path(checkpoint: Path) -> Path | None:
    """The events.jsonl of the run the checkpoint belongs to, or None.

    The engine writes ``<output_dir>/events.jsonl`` when run by hand; under the supervisor it writes
    ``<run_root>/runs/<id>/events.jsonl`` and ``<run_root>/runs/<id>/checkpoints`` links to its output dir's
    checkpoints, so the newest run whose link resolves there owns them.
    """
    output_dir = checkpoint.parent.parent
    direct = events_path_for(output_dir)
    if direct.is_file():
        return direct
    ck_root = checkpoint.parent.resolve()
    owners: list[Path] = []
    for ancestor in list(output_dir.resolve().parents)[:6]:
        runs = ancestor / "runs"
        if not runs.is_dir():
            continue
        for run_dir in runs.iterdir():
            link = run_dir / "checkpoints"
            try:
                if link.is_symlink() and link.resolve() == ck_root and (run_dir / "events.jsonl").is_file():
                    owners.append(run_dir / "events.jsonl")
            except OSError:
                continue
        if owners:
            break
    if not owners:
        return None
    return max(owners, key=lambda p: (p.stat().st_mtime, p.parent.name))


def record_export(result: ExportResult) -> Path | None:
    path = run_events_path(result.checkpoint)
    if path is None:
        return None
    log = EventLog(path, stdout=sys.stdout)
    try:
        log.emit(
            ExportEvent(
                path=str(result.out_dir),
                checkpoint=str(result.checkpoint),
                step=result.step,
                format=result.fmt,
                drafter=result.drafter,
            )
        )
    finally:
        log.close()
    return path


# --- the whole export -----------------------------------------------------------------------------------------------
def export_checkpoint(
    source: Path,
    out_dir: Path,
    *,
    fmt: str = "eagle3",
    drafter: str | None = None,
    verifier: str | None = None,
    record: bool = True,
    trained_weights: bool = False,
) -> ExportResult:
    """Validate everything, then write ``out_dir`` atomically; ExportError or checkpoint.CheckpointNotFound (nothing
    written) for bad input."""
    if fmt not in FORMATS:
        raise ExportError(f"format {fmt!r}; allowed: {', '.join(FORMATS)}")
    source = Path(source).expanduser().absolute()
    out_dir = Path(out_dir).expanduser().absolute()
    checkpoint, picked = ckpt.resolve_checkpoint(source)
    _check_out_dir(out_dir)
    meta = _read_meta(checkpoint)
    name = choose_drafter(meta, drafter)
    state, weights = _load_model_state(checkpoint, name, trained_weights=trained_weights)
    tensors = served_tensors(state, meta, fmt)
    step = int(meta.get("step", -1))
    cfg = meta.get("config") or {}
    provenance: dict[str, Any] = {
        "checkpoint": str(checkpoint),
        "step": step,
        "drafter": name,
        "target": cfg.get("target"),
        "target_layers": list(meta["target_layers"]),
        "ttt_steps": cfg.get("ttt_steps"),
        "weights": weights,
    }
    if "ttt_rope_offset" in cfg:
        provenance["ttt_rope_offset"] = cfg["ttt_rope_offset"]
    chosen_verifier = verifier if verifier is not None else default_verifier(meta)
    config = build_config(meta, fmt, verifier=chosen_verifier, provenance=provenance)
    size = _write_atomically(out_dir, config, tensors)
    params = sum(t.numel() for k, t in tensors.items() if t.is_floating_point())
    result = ExportResult(out_dir, checkpoint, step, name, fmt, params, size, picked, weights=weights)
    if fmt == "speculators" and chosen_verifier is None:
        result.notes.append("verifier name_or_path is null (built-in target); pass --verifier DIR to name one")
    if record:
        result.events_path = record_export(result)
    return result


# --- reading an export back -----------------------------------------------------------------------------------------
def read_export(out_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors under OUR names) of an export in either layout."""
    from safetensors.torch import load_file

    config = json.loads((Path(out_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    tensors = load_file(str(Path(out_dir) / WEIGHTS_FILE))
    return config, {our_name(k): v for k, v in tensors.items()}


def drafter_from_export(out_dir: Path, embed_weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> Any:
    """Our Drafter with an export's weights (in ``dtype``) and the given target embedding table."""
    from engine.trainer.draft.model import DraftConfig, Drafter

    config, tensors = read_export(out_dir)
    layer = config.get("transformer_layer_config", config)
    flags = served_flags(config)
    for flag, ours in ARCHITECTURE_FLAGS.items():
        if flags[flag] != ours:
            absent = "" if flag in config else " (absent: vLLM's default in this layout)"
            raise ExportError(
                f"{out_dir}: {flag} is {str(flags[flag]).lower()}{absent}; this drafter computes {flag} = "
                f"{str(ours).lower()}, so its weights would be read wrong"
            )
    dcfg = DraftConfig(
        hidden_size=int(layer["hidden_size"]),
        num_heads=int(layer["num_attention_heads"]),
        num_kv_heads=int(layer["num_key_value_heads"]),
        head_dim=int(layer["head_dim"]),
        intermediate_size=int(layer["intermediate_size"]),
        vocab_size=int(layer["vocab_size"]),
        draft_vocab_size=int(config["draft_vocab_size"]),
        rms_norm_eps=float(layer["rms_norm_eps"]),
        rope_theta=float(layer["rope_theta"]),
        initializer_range=float(layer.get("initializer_range", 0.02)),
    )
    d2t = tensors["d2t"]
    drafter = Drafter(dcfg, embed_weight.to(dtype), torch.arange(d2t.numel()) + d2t)
    drafter.load_state_dict({k: v if k in ("d2t", "t2d") else v.to(dtype) for k, v in tensors.items()})
    return drafter


def drafter_logits(drafter: Any, hidden3: torch.Tensor, input_ids: torch.Tensor, ttt_steps: int = 1) -> torch.Tensor:
    """Draft-vocabulary logits of each TTT step, ``(ttt_steps, B, T, Vd)``, through the training forward itself.

    Step 0 at position ``t`` reads the fused target state at ``t`` and the embedding of token ``t + 1`` (the
    served drafter's first proposal); the loss function only captures the logits.
    """
    from engine.trainer.draft.attention import TTTAttention

    captured: list[torch.Tensor] = []

    def capture(
        logits: torch.Tensor, _z: torch.Tensor, _lse: torch.Tensor, _m: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        captured.append(logits.detach().float())
        zero = logits.new_zeros(())
        return zero, zero, zero

    b, t = input_ids.shape
    with torch.no_grad():
        drafter(
            hidden3,
            input_ids,
            torch.zeros(b, t, drafter.cfg.draft_vocab_size),
            torch.zeros(b, t),
            torch.zeros(b, t),
            ttt_steps=ttt_steps,
            attention=TTTAttention("sdpa"),
            loss_fn=capture,
        )
    return torch.stack(captured)


# --- command line ---------------------------------------------------------------------------------------------------
def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def summary_lines(result: ExportResult) -> list[str]:
    lines = []
    if result.picked:
        lines.append(f"checkpoint {result.checkpoint.name} ({result.picked})")
    for note in result.notes:
        lines.append(f"note: {note}")
    recorded = f"; recorded in {result.events_path}" if result.events_path else ""
    lines.append(
        f"exported {result.drafter} of {result.checkpoint.name} (step {result.step}) -> {result.out_dir} "
        f"[{result.fmt}]: {result.params / 1e6:.2f}M params, bfloat16, {_human_bytes(result.size_bytes)}, "
        f"{result.weights} weights{recorded}"
    )
    lines.append(
        f'serve: vllm speculative_config={{"method": "eagle3", "model": "{result.out_dir}", '
        f'"num_speculative_tokens": 3}}'
    )
    return lines


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("checkpoint", help="a checkpoint directory (step_N) or a run output directory (its latest)")
    ap.add_argument("out_dir", help="the directory to create (must not exist, or be empty)")
    ap.add_argument("--format", dest="fmt", choices=FORMATS, default="eagle3", help="eagle3 (default) or speculators")
    ap.add_argument(
        "--drafter",
        help="which drafter state (independent mode has one per drafter; without it each goes to OUT_DIR/<name>/)",
    )
    ap.add_argument("--verifier", help="speculators layout: the target's name or directory to record as verifier")
    ap.add_argument(
        "--trained-weights",
        action="store_true",
        help="a run with ema_decay > 0: export the last trained weights, not their moving average (the default)",
    )


def export_every_drafter(
    source: Path,
    out_dir: Path,
    *,
    fmt: str = "eagle3",
    drafter: str | None = None,
    verifier: str | None = None,
    trained_weights: bool = False,
) -> list[ExportResult]:
    """One export, or, for a checkpoint of several drafters (independent mode) and no ``drafter`` named, one per
    drafter in ``out_dir/<drafter>/``: every drafter is checked before the first is written."""
    checkpoint, _picked = ckpt.resolve_checkpoint(Path(source).expanduser().absolute())
    names = [str(d) for d in _read_meta(checkpoint).get("drafters") or []]
    if drafter is not None or len(names) <= 1:
        return [
            export_checkpoint(
                source, out_dir, fmt=fmt, drafter=drafter, verifier=verifier, trained_weights=trained_weights
            )
        ]
    out_dir = Path(out_dir).expanduser().absolute()
    _check_out_dir(out_dir)
    meta = _read_meta(checkpoint)
    for name in names:  # a bad state fails here, before anything is written
        served_tensors(_load_model_state(checkpoint, name, trained_weights=trained_weights)[0], meta, fmt)
    return [
        export_checkpoint(
            source, out_dir / name, fmt=fmt, drafter=name, verifier=verifier, trained_weights=trained_weights
        )
        for name in names
    ]


def run(args: argparse.Namespace) -> int:
    try:
        results = export_every_drafter(
            Path(args.checkpoint),
            Path(args.out_dir),
            fmt=args.fmt,
            drafter=args.drafter,
            verifier=args.verifier,
            trained_weights=args.trained_weights,
        )
    except (ExportError, ckpt.CheckpointNotFound) as exc:  # input it cannot export: one line, exit 2
        print(f"specdec-train export: error: {exc}", file=sys.stderr)
        return 2
    if len(results) > 1:
        print(f"{len(results)} drafters, each in its own folder (--drafter NAME exports one):")
    for result in results:
        for line in summary_lines(result):
            print(line)
    return 0
