"""Benchmark (on demand, not a test): peak memory of training and of regenerate with one huge row in the data.

    python3 tests/bench/bench_row_memory.py [--row-mib 100] [--rows 200] [--steps 3] [--code DIR] [--limit-gib 8]

Writes the shipped corpus's first --rows conversations as a data file, and the same file with one conversation
of --row-mib MiB (a user turn of that size) in its middle, then runs, as fresh processes, each under a virtual
memory limit of --limit-gib:
  * training: ``specdec-train --preset cpu-demo`` for --steps steps on the tiny target (data read, tokenized,
    cached, trained);
  * regenerate: ``specdec-train regenerate`` with a random 2-layer Llama target over the whole file (8 new tokens
    a reply).
and prints each process's peak RSS (its own ru_maxrss, from wait4) with and without the huge row, the ratio, and
what the run said of the row. Goal: with the row within 10 % of without. --code DIR runs another checkout (e.g. a
`git worktree add` of an older commit); before engine/trainer/data/rows.py a 30 MB row took 6.6 GB, so an older
checkout is only safe with a small --row-mib.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def peak_rss_mib(cmd: list[str], code: Path, limit_gib: float, timeout_s: float) -> tuple[int, float, float, str]:
    """(exit code, peak RSS in MiB, wall seconds, the last lines of stderr) of ``cmd`` run as a fresh process."""

    def limited() -> None:
        limit = int(limit_gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    env = {**os.environ, "PYTHONPATH": str(code)}
    env.pop("SPECDEC_RUN_DIR", None)
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, cwd=code, env=env, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=limited)
        deadline = time.monotonic() + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)  # polling a child we started; nothing else to wait on
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall_s = time.perf_counter() - t0
        err.seek(0)
        tail = err.read().decode(errors="replace").splitlines()[-6:]
    return proc.returncode, usage.ru_maxrss / 1024, wall_s, "\n".join(tail)


def write_data(dir_: Path, rows: int, row_mib: int) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO))
    from engine.trainer.data.sources import shipped_corpus_path

    lines = shipped_corpus_path().read_text(encoding="utf-8").splitlines()[:rows]
    plain = dir_ / "plain.jsonl"
    plain.write_text("\n".join(lines) + "\n", encoding="utf-8")
    huge = dir_ / "huge.jsonl"
    with huge.open("wb") as f:
        for i, line in enumerate(lines):
            if i == len(lines) // 2:
                f.write(b'{"conversations": [{"from": "human", "value": "')
                for _ in range(row_mib):
                    f.write(b"word " * (MiB // 5) + b"w" * (MiB % 5))
                f.write(b'"}, {"from": "gpt", "value": "ok"}]}\n')
            f.write(line.encode() + b"\n")
    return plain, huge


def make_target(dir_: Path) -> Path:
    """A random 2-layer Llama with the byte tokenizer, saved as tiny-trained saves itself."""
    import torch
    from transformers import LlamaForCausalLM

    from engine.trainer.verifier.builtin import save_servable
    from engine.trainer.verifier.model_configs import tiny_config
    from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(((len(tok) + 7) // 8) * 8, hidden=32, layers=2, head_dim=16))
    path = dir_ / "target"
    save_servable(model, str(path))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row-mib", type=int, default=100)
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--code", type=Path, default=REPO, help="the checkout to run (default: this one)")
    ap.add_argument("--limit-gib", type=float, default=8.0, help="virtual memory limit of each process")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args()
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-row-memory-") as tmp:
        work = Path(tmp)
        plain, huge = write_data(work, args.rows, args.row_mib)
        # Built in a child of its own: a child's ru_maxrss starts from what its parent held at the fork, and torch
        # in this process (~400 MiB) would floor every figure below.
        maker = f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import bench_row_memory as b; "
        maker += f"from pathlib import Path; print(b.make_target(Path({str(work)!r})))"
        target = Path(subprocess.run([sys.executable, "-c", maker], cwd=args.code, check=True, capture_output=True,
                                     text=True).stdout.strip())  # fmt: skip
        print(f"data: {args.rows} conversations ({plain.stat().st_size / MiB:.2f} MiB); with one {args.row_mib} MiB "
              f"row: {huge.stat().st_size / MiB:.1f} MiB; code: {args.code}")  # fmt: skip
        train = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--set", f"steps={args.steps}"]
        train += ["--set", "step_delay_s=0", "--set", "checkpoint_every=0", "--set", "eval_holdout=8"]
        regen = [sys.executable, "-m", "engine.trainer", "regenerate", "--target", str(target), "--threads", "1"]
        regen += ["--max-new-tokens", "8", "--max-length", "1024", "--batch-size", "16"]
        for name, base in (("training", train), ("regenerate", regen)):
            for label, data in (("without", plain), ("with", huge)):
                run_dir = work / f"{name}-{label}"
                if name == "training":
                    cmd = [*base, "--set", f"data={data}", "--output-dir", str(run_dir)]
                else:
                    cmd = [*base, "--data", str(data), "--out", str(run_dir / "out.jsonl")]
                rc, peak, wall_s, tail = peak_rss_mib(cmd, args.code, args.limit_gib, args.timeout_s)
                said = [line for line in tail.splitlines() if "MiB" in line or "skipped" in line]
                results.setdefault(name, {})[label] = {"rc": rc, "peak_rss_mib": round(peak, 1), "wall_s": wall_s}
                print(f"{name:10s} {label:7s} the row: rc {rc}, peak RSS {peak:7.1f} MiB, {wall_s:5.1f} s"
                      + (f"\n    {said[-1][:300]}" if said else "") + ("" if rc == 0 else f"\n{tail}"))  # fmt: skip
            pair = results[name]
            ratio = float(pair["with"]["peak_rss_mib"]) / float(pair["without"]["peak_rss_mib"])  # type: ignore[index,arg-type]
            pair["ratio"] = round(ratio, 3)
            print(f"{name:10s} with/without: {ratio:.3f} ({'within' if ratio <= 1.10 else 'OVER'} the 10 % goal)")
    print("RESULT " + json.dumps({"row_mib": args.row_mib, "rows": args.rows, **results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
