"""Train SpecForge 0.2.0's EAGLE-3 drafter with its own trainer objects on given batches, then export it with
SpecForge's own exporter. Run by tests/bench/bench_quality.py with SpecForge's site directory on PYTHONPATH; never
imported by the package.

The assembly is the shared peer's ``specforge/sf_peer.py`` (SpecForge 0.2.0 runs its target only behind an SGLang
capture server; that driver builds the trainer side exactly as ``specforge train`` does and puts a Hugging Face target
forward where the capture server would be): SpecForge's ``Config``, ``build_model_bundle`` (draft model, frozen
``TargetHead`` from the target's lm_head, ``OnlineEagle3Model``), its optimizer factory (BF16Optimizer, fp32 masters),
``FSDPTrainingBackend`` (1-rank FSDP on CUDA; its NO_SHARD/DDP branch on the CPU), ``Eagle3TrainStrategy``,
``TrainerCore``, ``TrainerController.fit()``. Copied and changed here (the repository never points outside itself):

* the target is a servable Hugging Face directory (the bench's built ``tiny-trained``), not a random one;
* the batches are the bench's (the same token ids, loss masks and order as our engine trains on for this seed), the
  draft vocabulary is the bench's (ours, passed as SpecForge's ``vocab_mapping_path``);
* the hyperparameters both trainers expose are the bench's (lr, schedule and warm-up share: constant and none, or
  SpecForge's default cosine and 0.015; grad clip, TTT length, seed); LK losses are SpecForge's ``lk_loss_type`` /
  ``kl_scale`` / ``kl_decay``;
* on the CPU: float32 end to end (SpecForge's ``TargetHead`` hard-codes bfloat16: cast back to float32 so the
  target's logits are those of our float32 engine), SDPA attention (flex has no CPU backward), SpecForge's reference
  loss ``core/loss.py _compute_loss`` in place of its Triton kernel, no ``torch.compile`` (``--compile auto``: on
  CUDA only, as our engine); on CUDA everything as SpecForge ships it (bfloat16, flex attention, Triton loss);
* after training: ``TrainerController.save_checkpoint`` and ``specforge.export.to_sglang.export_to_sglang`` write the
  ``LlamaForCausalLMEagle3`` directory vLLM and SGLang load.

    python3 sf_quality_train.py --target DIR --batches FILE --vocab FILE --steps N --seed S --out EXPORT_DIR \\
        [--loss soft_ce|lk_lambda|lk_alpha] [--device cpu|cuda] [--schedule constant|cosine --warmup-ratio R]
        [--json RESULT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

LK_TYPES = {"soft_ce": None, "lk_lambda": "lambda", "lk_alpha": "alpha"}


def log(msg: str) -> None:
    print(f"[sf_quality] {msg}", file=sys.stderr, flush=True)


def write_target_skeleton(target_dir: Path, path: Path) -> None:
    """config.json + the two tensors SpecForge's trainer reads from the target directory (the embedding for the draft,
    lm_head for TargetHead) with a safetensors index, as sf_peer.py writes them. A tied lm_head is the embedding."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(target_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    tensors = {
        "model.embed_tokens.weight": embed.contiguous(),
        "lm_head.weight": weights.get("lm_head.weight", embed).clone().contiguous(),
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text((target_dir / "config.json").read_text())
    save_file(tensors, str(path / "model-embed-head.safetensors"))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: "model-embed-head.safetensors" for k in tensors}}  # fmt: skip
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def draft_config_file(tcfg: dict[str, Any], draft_vocab: int, path: Path, layers: list[int] | None = None) -> Path:
    """SpecForge's configs/llama3-8B-eagle3.json with the target's shapes, as sf_peer.py scales it for tiny targets,
    plus the target's head_dim and rope (the served drafter's rotary must be the target's). ``layers`` (target layer
    OUTPUT ids, 0-based): SpecForge captures those (its resolver reads ``eagle_config``'s ids, SGLang's sense) and
    vLLM is told them as layer inputs (the top-level ids, each + 1); None: everyone's default."""
    rope = tcfg.get("rope_parameters") or {}
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "bos_token_id": tcfg.get("bos_token_id"),
        "eos_token_id": tcfg.get("eos_token_id"),
        "pad_token_id": tcfg.get("pad_token_id", 0),
        "hidden_act": "silu",
        "hidden_size": tcfg["hidden_size"],
        "initializer_range": 0.02,
        "intermediate_size": tcfg["intermediate_size"],
        "max_position_embeddings": tcfg.get("max_position_embeddings", 2048),
        "model_type": "llama",
        "num_attention_heads": tcfg["num_attention_heads"],
        "num_key_value_heads": tcfg["num_key_value_heads"],
        "head_dim": tcfg.get("head_dim") or tcfg["hidden_size"] // tcfg["num_attention_heads"],
        "num_hidden_layers": 1,
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-5),
        "rope_theta": float(tcfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": tcfg["vocab_size"],
        "draft_vocab_size": draft_vocab,
    }
    if layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layers)}
        cfg["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in layers]
    path.write_text(json.dumps(cfg, indent=1))
    return path


def run(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    cuda = a.device.startswith("cuda")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    if (a.compile == "auto" and not cuda) or a.compile == "off":
        torch._dynamo.config.disable = True  # SpecForge's @torch.compile helpers run eagerly (the same functions)
    dev = torch.device(a.device)
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    target_dir = Path(a.target)
    tcfg = json.loads((target_dir / "config.json").read_text())
    batches = torch.load(a.batches, map_location="cpu", weights_only=True)
    ids_list, mask_list = batches["input_ids"], batches["loss_mask"]
    if len(ids_list) < a.steps:
        raise ValueError(f"{a.batches} holds {len(ids_list)} batches; {a.steps} steps asked")
    vocab = torch.load(a.vocab, map_location="cpu", weights_only=True)
    draft_vocab = int(vocab["d2t"].numel())
    skeleton = work / "target-skeleton"
    write_target_skeleton(target_dir, skeleton)
    draft_json = draft_config_file(tcfg, draft_vocab, work / "draft_config.json", a.layers)
    dtype = "bfloat16" if cuda else "float32"
    attn = a.attn if a.attn != "auto" else ("flex_attention" if cuda else "sdpa")
    from specforge.config import Config

    feat_dir = work / "features-unused"
    feat_dir.mkdir(exist_ok=True)
    cfg = Config.model_validate({
        "model": {"target_model_path": str(skeleton), "draft_model_config": str(draft_json),
                  "vocab_mapping_path": str(a.vocab), "embedding_key": "model.embed_tokens.weight",
                  "torch_dtype": dtype},
        "data": {"hidden_states_path": str(feat_dir), "max_length": max(int(x.shape[1]) for x in ids_list)},
        "training": {"strategy": "eagle3", "num_epochs": 1, "max_steps": a.steps,
                     "batch_size": int(ids_list[0].shape[0]),
                     "learning_rate": a.lr, "lr_scheduler": a.schedule, "warmup_ratio": a.warmup_ratio,
                     "max_grad_norm": a.max_grad_norm, "ttt_length": a.ttt, "attention_backend": attn,
                     "save_interval": 0, "log_interval": 1, "seed": a.seed, "lk_loss_type": LK_TYPES[a.loss],
                     "kl_scale": a.kl_scale, "kl_decay": a.kl_decay},
        "run_id": "bench-quality", "output_dir": str(work / "output"),
        "deployment": {"mode": "local_colocated", "trainer": {"nnodes": 1, "nproc_per_node": 1}},
    })  # fmt: skip
    from specforge.cli import _bootstrap_single_process_env
    from specforge.distributed import init_distributed

    _bootstrap_single_process_env()
    init_distributed(timeout=cfg.training.dist_timeout, tp_size=1, sp_ulysses_size=1, sp_ring_size=1)
    from accelerate.utils import set_seed

    set_seed(cfg.training.seed)
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.training.assembly import _optimizer_factory, build_model_bundle

    if not cuda:  # SpecForge's loss is a Triton kernel; on the CPU its reference beside it (sf_peer.py does so too)
        import specforge.algorithms.eagle3.model as sf_eagle3
        from specforge.core.loss import _compute_loss

        class _RefLoss:
            @staticmethod
            def apply(logits: Any, target_p: Any, position_mask: Any) -> Any:
                return _compute_loss(logits, target_p, position_mask)

        sf_eagle3.LogSoftmaxLoss = _RefLoss
    algorithm = builtin_algorithm_registry().resolve("eagle3")
    bundle = build_model_bundle(cfg, algorithm=algorithm)
    if not cuda:
        bundle.target_head.float()  # from_pretrained casts it to bfloat16; the CPU comparison runs float32 throughout
    from transformers import AutoConfig

    resolve = algorithm.providers.model.resolve_capture_layers
    layer_ids = list(resolve(cfg, bundle.draft_config, AutoConfig.from_pretrained(str(skeleton))))
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.backend import FSDPTrainingBackend, ParallelConfig
    from specforge.training.controller import TrainerController, TrainerCore

    factory = _optimizer_factory(cfg)
    factory.configure_total_steps(a.steps)
    if not cuda:  # FSDP1 refuses a CPU-only process; SpecForge's NO_SHARD (DDP) branch
        os.environ["FSDP_SHARDING"] = "NO_SHARD"
    backend = FSDPTrainingBackend(ParallelConfig.from_distributed(tp_size=1, sp_ulysses_size=1, sp_ring_size=1),
                                  optimizer_factory=factory)  # fmt: skip
    wrapped = backend.prepare_model(bundle.model, optimizer_target=bundle.model.draft_model)
    strategy = algorithm.providers.step.build(wrapped, target_head=bundle.target_head, **dict(bundle.strategy_kwargs))
    core = TrainerCore(strategy, backend, accumulation_steps=1)
    log(f"assembled: {type(bundle.model.draft_model).__name__}, wrapper {backend._wrapper_kind}, layers {layer_ids}, "
        f"{dtype}, {attn}, loss {a.loss}")  # fmt: skip

    from transformers import LlamaForCausalLM

    target: Any = LlamaForCausalLM.from_pretrained(str(target_dir), dtype=getattr(torch, dtype))
    target = target.to(dev)
    target.eval().requires_grad_(False)
    captured: dict[int, Any] = {}
    for idx in layer_ids:
        target.model.layers[idx].register_forward_hook(
            lambda _m, _i, o, idx=idx: captured.__setitem__(idx, o[0] if isinstance(o, tuple) else o)
        )

    def stream() -> Any:
        for i in range(a.steps):
            input_ids = ids_list[i].to(dev)
            loss_mask = mask_list[i].to(dev).long()
            loss_mask[:, -1] = 0  # SpecForge's normaliser clears the last loss position
            attention_mask = torch.ones_like(input_ids)  # causal: the padding after a conversation changes nothing
            with torch.no_grad():
                captured.clear()
                last = target.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
                aux = torch.cat([captured[j] for j in layer_ids], dim=-1)
            yield TrainBatch(
                sample_ids=[f"b{i}r{r}" for r in range(int(input_ids.shape[0]))], strategy="eagle3",
                tensors={"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask,
                         "hidden_state": aux, "target": last.last_hidden_state},
                metadata={"target_repr": "hidden_state", "ttt_length": a.ttt})  # fmt: skip

    stamps: list[tuple[int, float, float]] = []

    def logger(metrics: dict[str, Any], step: int) -> None:
        stamps.append((step, time.perf_counter(), float(metrics.get("loss", float("nan")))))
        if step == 1 or step % max(1, a.steps // 10) == 0 or step == a.steps:
            log(f"step {step}: loss {stamps[-1][2]:.4f}, lr {float(metrics.get('lr', float('nan'))):.3g}")

    controller = TrainerController(core, run_id=cfg.run_id, output_dir=cfg.output_dir, save_interval=0,
                                   log_interval=1, max_steps=a.steps, total_steps=a.steps, num_epochs=1,
                                   logger=logger)  # fmt: skip
    t0 = time.perf_counter()
    controller.fit(stream())
    fit_s = time.perf_counter() - t0
    checkpoint = controller.save_checkpoint(a.steps)
    from specforge.export.to_sglang import export_to_sglang

    export_to_sglang(checkpoint.checkpoint_uri, str(draft_json), str(out), vocab_mapping_path=str(a.vocab))
    steady = [s for s in stamps if s[0] >= 1]
    tokens_after_first = sum(int(ids_list[i].numel()) for i in range(1, a.steps))
    span = steady[-1][1] - steady[0][1] if len(steady) > 1 else float("nan")
    return {
        "trainer": "specforge-0.2.0",
        "steps": len(stamps),
        "fit_s": round(fit_s, 1),
        "first_step_s": round(stamps[0][1] - t0, 1) if stamps else None,
        "tok_s": round(tokens_after_first / span, 1) if span == span and span > 0 else None,
        "loss_first_last": [stamps[0][2], stamps[-1][2]] if stamps else None,
        "capture_layers": layer_ids,
        "dtype": dtype,
        "attention": attn,
        "export": str(out),
        "versions": {"torch": torch.__version__, "specforge": _version("specforge")},
    }


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--batches", required=True)
    ap.add_argument("--vocab", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--schedule", choices=["constant", "cosine"], default="constant")
    ap.add_argument("--warmup-ratio", type=float, default=0.0)
    ap.add_argument("--loss", choices=sorted(LK_TYPES), default="soft_ce")
    ap.add_argument("--kl-scale", type=float, default=1.0)
    ap.add_argument("--kl-decay", type=float, default=1.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attn", default="auto", choices=["auto", "sdpa", "flex_attention"])
    ap.add_argument("--compile", default="auto", choices=["auto", "on", "off"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--work", required=True)
    ap.add_argument("--out", required=True, help="the export directory to write")
    ap.add_argument("--json", help="write the result object here too")
    ap.add_argument("--layers", type=lambda v: [int(i) for i in v.split(",")], default=None,
                    help="the target layers to capture, as output ids (e.g. 3,5,7); default SpecForge's")  # fmt: skip
    a = ap.parse_args()
    try:
        res = run(a)
        res["ok"] = True
    except BaseException as exc:
        res = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        traceback.print_exc()
    line = json.dumps(res, default=str)
    print("RESULT " + line, flush=True)
    if a.json:
        Path(a.json).write_text(line + "\n")
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
