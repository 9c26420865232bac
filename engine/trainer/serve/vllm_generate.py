"""Run by the interpreter that has vLLM (never imported by the engine): greedy generation of token-id prompts
with an EAGLE-3 drafter as vLLM's speculator, and vLLM's speculative-decoding counters, as one JSON line.

    PYTHON engine/trainer/serve/vllm_generate.py REQUEST.json

REQUEST: ``{"target", "drafter" (null: no speculation), "k", "prompts": [[ids]], "max_tokens", "ignore_eos",
"dtype", "max_model_len"}``. Prints ``RESULT {json}`` on stdout: ``vllm`` (version), ``outputs`` (generated ids per
prompt), ``spec_decode`` (each ``vllm:spec_decode_*`` metric: a number, or a list per draft position),
``load_s``, ``generate_s``; or ``error`` and ``traceback_tail``. Only the standard library and vLLM are imported:
the interpreter may be another venv's. A file with a ``__main__`` guard, because vLLM starts its engine core with
spawn, which imports the main module again.
"""

import json
import sys
import time
import traceback
from typing import Any


def run(request: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"vllm": None}
    try:
        import vllm
        from vllm import LLM, SamplingParams

        out["vllm"] = vllm.__version__
        spec = None
        if request.get("drafter"):
            spec = {"method": "eagle3", "model": request["drafter"], "num_speculative_tokens": int(request["k"])}
        t0 = time.perf_counter()
        llm = LLM(
            model=request["target"],
            tokenizer=request["target"],
            dtype=request.get("dtype", "float32"),
            max_model_len=int(request.get("max_model_len", 2048)),
            max_num_seqs=8,
            enforce_eager=True,
            disable_log_stats=False,
            speculative_config=spec,
        )
        out["load_s"] = round(time.perf_counter() - t0, 1)
        params = SamplingParams(
            temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=bool(request["ignore_eos"])
        )
        t0 = time.perf_counter()
        prompts = [{"prompt_token_ids": list(p)} for p in request["prompts"]]
        results = llm.generate(prompts, params, use_tqdm=False)
        out["generate_s"] = round(time.perf_counter() - t0, 1)
        out["outputs"] = [list(r.outputs[0].token_ids) for r in results]
        metrics: dict[str, Any] = {}
        for m in llm.get_metrics():
            if "spec_decode" in m.name:
                value = getattr(m, "value", None)
                if value is None and hasattr(m, "values"):
                    value = list(m.values)
                metrics[m.name] = value
        out["spec_decode"] = metrics
    except BaseException as exc:  # the caller reports it: this process only answers
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback_tail"] = traceback.format_exc().splitlines()[-25:]
    return out


def main() -> None:
    with open(sys.argv[1], encoding="utf-8") as f:
        request = json.load(f)
    print("RESULT " + json.dumps(run(request), default=str), flush=True)


if __name__ == "__main__":
    main()
