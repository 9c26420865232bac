#!/bin/sh
# What training against the FP8 target costs in acceptance length, on the lent machine's CPU cores (results
# under $OUT): the same drafter recipe trained on tiny-trained with the exact target and with target_fp8, both
# measured as served (exact target). Usage: sh tests/device/fp8_acceptance.sh [STEPS]
set -u
OUT=${OUT:-/tmp/out}
STEPS=${1:-1500}
mkdir -p "$OUT"
python3 -c "from engine.trainer.verifier.builtin import ensure_built; ensure_built()" > "$OUT/target_build.txt" 2>&1
for v in rope1-new rope1-new-fp8; do
    timeout 480 python3 tests/bench/bench_acceptance.py --variants "$v" --steps "$STEPS" --k 5 --conversations 32 \
        --max-new-tokens 128 --torch-threads 7 --work "/tmp/acc/$v" --out "$OUT/acc_$v.json" > "$OUT/acc_$v.txt" 2>&1 &
done
wait
tail -n 3 "$OUT"/acc_*.txt
