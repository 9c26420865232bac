"""How far the FP8 target (``target_fp8``) moves what the drafter trains on, and how much faster its forward is.

For each target the same token batches go through the bf16 target and its FP8 copy (engine/trainer/verifier/fp8.py),
and the bench prints (engine/trainer/verifier/agreement.py measures the first five, as an FP8 run does at its start on
its first training batches' loss-masked positions; here every position of repeated held-out prompts):

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


def token_batches(
    prompts: list[list[int]] | None, vocab_size: int, batch: int, seq: int, n: int, *, seed: int = 0
) -> list[Any]:
    """``n`` batches of ``batch`` rows of ``seq`` tokens: each prompt repeated up to the length (text at every
    position, many of them copies: a run measures its own training batches instead), or seeded random ids when there
    are no prompts (a random-weight target)."""
    import torch

    if not prompts:
        g = torch.Generator().manual_seed(seed)
        return [torch.randint(0, vocab_size, (batch, seq), generator=g) for _ in range(n)]
    rows = [torch.tensor((p * (seq // max(1, len(p)) + 1))[:seq]) for p in prompts[: batch * n]]
    stacked = torch.stack(rows)
    return [b for b in (stacked[i * batch : (i + 1) * batch] for i in range(n)) if len(b)]


def measure(spec: str, device: str, batch: int, seq: int, n: int, compile_: bool, draft_vocab: int) -> dict[str, Any]:
    import torch

    from engine.trainer.serve.evaluate import heldout_prompts
    from engine.trainer.verifier.agreement import CheckBatch, compare_forwards
    from engine.trainer.verifier.fp8 import quantize_linears
    from engine.trainer.verifier.model import FrozenTarget, load_target, load_tokenizer

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    tok = load_tokenizer(spec)
    ref = load_target(spec, dev, tokenizer=tok, layer_ids=None, seed=0, dtype=dtype)
    # The same weights, quantised: a deep copy of the bf16 model (load_target(fp8=True) would rebuild it).
    model8 = copy.deepcopy(ref.model)
    replaced = quantize_linears(model8)
    fp8 = FrozenTarget(model8, tok, ref.layer_ids, dev)
    prompts = heldout_prompts(tok, "shipped", 64, 0, batch * n) if tok is not None else None
    batches = token_batches(prompts, ref.vocab_size, batch, seq, n)
    counts = torch.bincount(torch.cat([b.flatten() for b in batches]), minlength=ref.vocab_size)
    draft_ids = torch.argsort(counts, descending=True, stable=True)[: min(draft_vocab, ref.vocab_size)].sort().values
    draft_ids = draft_ids.to(dev)
    t2d = torch.zeros(ref.vocab_size, dtype=torch.bool, device=dev)
    t2d[draft_ids] = True
    if compile_ and dev.type == "cuda":
        ref.compile()
        fp8.compile()
    agreement = compare_forwards(
        ref.logits_and_hidden3, fp8.logits_and_hidden3, [CheckBatch(b.to(dev)) for b in batches], draft_ids, t2d
    )
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
    return {
        "target": spec,
        "device": device,
        "batch": batch,
        "seq": seq,
        "batches": n,
        "fp8_linears": replaced,
        "draft_vocab": int(draft_ids.numel()),
        **{k: v for k, v in agreement.to_dict().items() if k != "positions"},
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
