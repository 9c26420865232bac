#!/bin/sh
# Issue 12's one-H200 throughput candidates in one device call (run from the repo root; results under $OUT):
#   1. the FP8 target against bf16 on the 8B shape: agreement, KL of target_p, hidden-state error, eager forward time
#   2. the engine at batch B (default 4): bf16 target, then FP8 target (tests/bench/bench_engine.py, same call)
# Usage: sh tests/device/throughput_runs.sh [BATCH] [EXTRA_PLAN_ITEMS]
set -u
OUT=${OUT:-/tmp/out}
B=${1:-4}
PLAN=${2:-"engine;engine --set target_fp8=true"}
mkdir -p "$OUT"
timeout 120 python3 tests/bench/bench_fp8_target.py --targets llama3-8b-shape --device cuda:0 --batch "$B" --seq 2048 \
    --batches 2 --out "$OUT/fp8_accuracy.json" > "$OUT/fp8_accuracy.txt" 2>&1
echo "fp8 accuracy exit $?" >> "$OUT/fp8_accuracy.txt"
timeout 460 python3 tests/bench/bench_engine.py all --batch "$B" --steps 20 --warm 5 --timeout-s 225 --plan "$PLAN" \
    --out "$OUT" > "$OUT/engine.txt" 2>&1
echo "engine exit $?" >> "$OUT/engine.txt"
tail -n 3 "$OUT"/fp8_accuracy.txt
grep -E '"mode"|"tok_s"|mfu|"error"|phase|producer_target_ms|peak_gib' "$OUT/engine.txt"
