"""Run by the interpreter that has vLLM (tests/bench/bench_quality.py starts it; never imported by the package):
serve several EAGLE-3 drafters, one after another, with one target, each at every temperature asked, and report
vLLM's own speculative-decoding counters per (drafter, temperature) as JSON lines.

    PYTHON quality_vllm.py REQUEST.json

REQUEST: ``{"target", "drafters": [{"name", "dir"}], "k", "prompts": [[ids]], "max_tokens", "ignore_eos", "dtype",
"max_model_len", "temperatures": [0.0, 1.0], "sampling_seed", "rejection_sample_method", "draft_sample_method"}``.
Each drafter gets one ``LLM`` whose speculative config pins ``rejection_sample_method`` and ``draft_sample_method``
(vLLM's defaults: standard, greedy); temperature 0 requests are greedy whatever those say, temperature > 0 requests
are sampled with ``seed = sampling_seed + prompt index`` (repeatable; ``sampling_seed`` null: unseeded). The
counters (``vllm:spec_decode_*``) are cumulative per LLM, so each temperature's figures are the difference across
its ``generate`` call. One line per (drafter, temperature): ``RESULT {"name", "temperature", "spec_decode",
"outputs", "generate_s", "load_s"}``, or ``RESULT {"name", "error", "traceback_tail"}``. Only the standard library
and vLLM are imported. A file with a ``__main__`` guard: vLLM starts its engine core with spawn, which imports the
main module again.
"""

import gc
import json
import sys
import time
import traceback
from typing import Any


def counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in llm.get_metrics():
        if "spec_decode" in m.name:
            value = getattr(m, "value", None)
            if value is None and hasattr(m, "values"):
                value = list(m.values)
            out[m.name] = value
    return out


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            prior = old if isinstance(old, list) else [0] * len(value)
            out[name] = [a - b for a, b in zip(value, prior + [0] * (len(value) - len(prior)), strict=False)]
        elif isinstance(value, (int, float)):
            out[name] = value - (old if isinstance(old, (int, float)) else 0)
    return out


def serve_one(request: dict[str, Any], drafter: dict[str, Any]) -> None:
    import vllm
    from vllm import LLM, SamplingParams

    spec = {
        "method": "eagle3",
        "model": drafter["dir"],
        "num_speculative_tokens": int(request["k"]),
        "rejection_sample_method": request["rejection_sample_method"],
        "draft_sample_method": request["draft_sample_method"],
    }
    t0 = time.perf_counter()
    llm = LLM(
        model=request["target"],
        tokenizer=request["target"],
        dtype=request.get("dtype", "float32"),
        max_model_len=int(request["max_model_len"]),
        max_num_seqs=8,
        enforce_eager=True,
        disable_log_stats=False,
        speculative_config=spec,
    )
    load_s = round(time.perf_counter() - t0, 1)
    prompts = [{"prompt_token_ids": list(p)} for p in request["prompts"]]
    for temperature in request["temperatures"]:
        if float(temperature) == 0.0:
            params: Any = SamplingParams(
                temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=bool(request["ignore_eos"])
            )
        else:
            params = [
                SamplingParams(
                    temperature=float(temperature),
                    max_tokens=int(request["max_tokens"]),
                    ignore_eos=bool(request["ignore_eos"]),
                    seed=None if request["sampling_seed"] is None else int(request["sampling_seed"]) + i,
                )
                for i in range(len(prompts))
            ]
        before = counters(llm)
        t1 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        row = {
            "name": drafter["name"],
            "temperature": float(temperature),
            "vllm": vllm.__version__,
            "speculative_config": spec,
            "load_s": load_s,
            "generate_s": round(time.perf_counter() - t1, 1),
            "spec_decode": difference(counters(llm), before),
            "outputs": [list(r.outputs[0].token_ids) for r in results],
        }
        print("RESULT " + json.dumps(row, default=str), flush=True)
    del llm
    gc.collect()


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        request = json.load(f)
    for drafter in request["drafters"]:
        try:
            serve_one(request, drafter)
        except BaseException as exc:  # the caller reports it: this process only answers
            row = {"name": drafter["name"], "error": f"{type(exc).__name__}: {exc}"}
            row["traceback_tail"] = traceback.format_exc().splitlines()[-25:]
            print("RESULT " + json.dumps(row, default=str), flush=True)


if __name__ == "__main__":
    main()
