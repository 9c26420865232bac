"""How far the FP8 target (``target_fp8``) moves what the drafter trains on, and how much faster its forward is.

For each target the same token batches go through the bf16 target and its FP8 copy (engine/trainer/target/fp8.py),
and the bench prints:

  top1_agree       share of positions whose full-vocabulary argmax is the same (it sets the position mask)
  mask_agree       share of positions whose position mask (top token in the draft vocabulary) is the same
  kl_target_p      mean KL(p_bf16 || p_fp8) of the draft-vocabulary distributions (nats per position)
  tv_target_p      mean total-variation distance of the same distributions
  hidden_rel_err   ||h_fp8 - h_bf16|| / ||h_bf16|| of the three captured layers (the drafter's input)
  fwd_ms           forward time of each (CUDA: after warm-up; --compile compiles both as the engine does)

Targets: ``tiny-trained`` on held-out conversations of the shipped corpus (a model that learned real text;
built on first use), and ``llama3-8b-shape`` (random weights, random tokens: the 8B matmul shapes, whose
near-flat distributions make top-1 ties common, so its agreement is a floor).

    python3 tests/bench/bench_fp8_target.py --targets tiny-trained,llama3-8b-shape --batch 4 --seq 2048
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def token_batches(spec: str, tokenizer: Any, vocab_size: int, batch: int, seq: int, n: int) -> list[Any]:
    import torch

    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, vocab_size, (batch, seq), generator=g) for _ in range(n)]
    from engine.trainer.serve.evaluate import heldout_prompts

    prompts = heldout_prompts(tokenizer, "shipped", 64, 0, batch * n)
    rows = []
    for p in prompts:  # each prompt repeated up to the length: real text at every position
        row = (p * (seq // max(1, len(p)) + 1))[:seq]
        rows.append(torch.tensor(row))
    stacked = torch.stack(rows)
    return [stacked[i * batch : (i + 1) * batch] for i in range(n)]


def measure(spec: str, device: str, batch: int, seq: int, n: int, compile_: bool, draft_vocab: int) -> dict[str, Any]:
    import torch

    from engine.trainer.target.fp8 import quantize_linears
    from engine.trainer.target.model import FrozenTarget, load_target, load_tokenizer

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tok = load_tokenizer(spec)
    ref = load_target(spec, dev, tokenizer=tok, layer_ids=None, seed=0, dtype=dtype)
    # The same weights, quantised: a deep copy of the bf16 model (load_target(fp8=True) would rebuild it).
    model8 = copy.deepcopy(ref.model)
    replaced = quantize_linears(model8)
    fp8 = FrozenTarget(model8, tok, ref.layer_ids, dev)
    batches = token_batches(spec, tok, ref.vocab_size, batch, seq, n)
    counts = torch.bincount(torch.cat([b.flatten() for b in batches]), minlength=ref.vocab_size)
    draft_ids = torch.argsort(counts, descending=True, stable=True)[: min(draft_vocab, ref.vocab_size)].sort().values
    draft_ids = draft_ids.to(dev)
    t2d = torch.zeros(ref.vocab_size, dtype=torch.bool, device=dev)
    t2d[draft_ids] = True
    if compile_ and dev.type == "cuda":
        ref.compile()
        fp8.compile()
    sums = {"top1": 0.0, "mask": 0.0, "kl": 0.0, "tv": 0.0, "herr_num": 0.0, "herr_den": 0.0, "n": 0.0}
    for ids in batches:
        ids = ids.to(dev)
        ones = torch.ones(ids.shape, device=dev)
        lo_a, h_a = ref.logits_and_hidden3(ids)
        lo_b, h_b = fp8.logits_and_hidden3(ids)
        out_a = ref.run(ids, ones, draft_ids, t2d)
        out_b = fp8.run(ids, ones, draft_ids, t2d)
        pa, pb = out_a.target_p.double(), out_b.target_p.double()
        sums["top1"] += (lo_a.argmax(-1) == lo_b.argmax(-1)).double().sum().item()
        sums["mask"] += (out_a.position_mask == out_b.position_mask).double().sum().item()
        sums["kl"] += (pa * (pa.clamp_min(1e-30).log() - pb.clamp_min(1e-30).log())).sum(-1).sum().item()
        sums["tv"] += (0.5 * (pa - pb).abs().sum(-1)).sum().item()
        sums["herr_num"] += (h_b.double() - h_a.double()).pow(2).sum().item()
        sums["herr_den"] += h_a.double().pow(2).sum().item()
        sums["n"] += ids.numel()
    times: dict[str, float] = {}
    if dev.type == "cuda":
        ids = batches[0].to(dev)
        for name, t in (("bf16", ref), ("fp8", fp8)):
            for _ in range(3):
                t.logits_and_hidden3(ids)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            reps = 10
            for _ in range(reps):
                t.logits_and_hidden3(ids)
            torch.cuda.synchronize()
            times[name] = 1000 * (time.perf_counter() - t0) / reps
    n_pos = sums["n"]
    return {
        "target": spec,
        "device": device,
        "batch": batch,
        "seq": seq,
        "batches": n,
        "fp8_linears": replaced,
        "draft_vocab": int(draft_ids.numel()),
        "top1_agree": sums["top1"] / n_pos,
        "mask_agree": sums["mask"] / n_pos,
        "kl_target_p": sums["kl"] / n_pos,
        "tv_target_p": sums["tv"] / n_pos,
        "hidden_rel_err": (sums["herr_num"] / sums["herr_den"]) ** 0.5,
        "fwd_ms": times,
        "fwd_speedup": times["bf16"] / times["fp8"] if times else None,
        "compiled": bool(compile_ and dev.type == "cuda"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="tiny-trained")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = []
    for spec in args.targets.split(","):
        r = measure(spec, args.device, args.batch, args.seq, args.batches, args.compile, args.draft_vocab)
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
