#!/bin/sh
# One device call for the 2026-12-01 issues (run from the repo root on a lent H200; results under $OUT):
#   1. acceptance length on the CPU cores, four fidelity variants in parallel (background, tests/bench/bench_acceptance.py)
#   2. the host-side holder mapping against real NVML (tests/device/host_map_nvml.py)
#   3. the engine as one torchrun rank on CUDA: the NCCL code path with world size 1 (bench_engine.py ranks --nproc 1)
#   4. the restart policy against a real CUDA OOM (tests/device/restart_oom.py)
# Usage: sh tests/device/session_runs.sh [ACCEPT_STEPS]
set -u
OUT=${OUT:-/tmp/out}
STEPS=${1:-1500}
mkdir -p "$OUT"
python3 -c "import sys; from engine.trainer.builtin_target import ensure_built; ensure_built()" > "$OUT/target_build.txt" 2>&1
for v in rope0-old rope0-new rope1-old rope1-new; do
    timeout 430 python3 tests/bench/bench_acceptance.py --variants "$v" --steps "$STEPS" --k 5 --conversations 32 \
        --max-new-tokens 128 --torch-threads 3 --work "/tmp/acc/$v" --out "$OUT/acc_$v.json" > "$OUT/acc_$v.txt" 2>&1 &
done
timeout 120 python3 tests/device/host_map_nvml.py --gib 4 > "$OUT/host_map.txt" 2>&1
echo "host_map exit $?" >> "$OUT/host_map.txt"
timeout 330 python3 tests/bench/bench_engine.py ranks --nproc 1 --batch 2 --steps 12 --warm 3 --timeout-s 320 \
    > "$OUT/ranks1.txt" 2>&1
echo "ranks exit $?" >> "$OUT/ranks1.txt"
timeout 120 python3 tests/device/restart_oom.py > "$OUT/restart_oom.txt" 2>&1
echo "restart_oom exit $?" >> "$OUT/restart_oom.txt"
wait
tail -n 3 "$OUT"/*.txt
