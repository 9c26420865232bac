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
W=/tmp/session_runs  # the device returns at most 8 files: everything is gathered into two at the end
mkdir -p "$OUT" "$W"
python3 -c "import sys; from engine.trainer.verifier.builtin import ensure_built; ensure_built()" > "$W/target_build.txt" 2>&1
for v in rope0-old rope0-new rope1-old rope1-new; do
    timeout 430 python3 tests/bench/bench_acceptance.py --variants "$v" --steps "$STEPS" --k 5 --conversations 32 \
        --max-new-tokens 128 --torch-threads 3 --work "/tmp/acc/$v" --out "$W/acc_$v.json" > "$W/acc_$v.txt" 2>&1 &
done
timeout 120 python3 tests/device/host_map_nvml.py --gib 4 > "$W/host_map.txt" 2>&1
echo "host_map exit $?" >> "$W/host_map.txt"
timeout 330 python3 tests/bench/bench_engine.py ranks --nproc 1 --batch 2 --steps 12 --warm 3 --timeout-s 320 \
    > "$W/ranks1.txt" 2>&1
echo "ranks exit $?" >> "$W/ranks1.txt"
timeout 120 python3 tests/device/restart_oom.py > "$W/restart_oom.txt" 2>&1
echo "restart_oom exit $?" >> "$W/restart_oom.txt"
wait
for f in "$W"/*.txt; do echo "===== $(basename "$f")"; cat "$f"; done > "$OUT/session_runs.txt"
python3 -c "import json,glob,sys; json.dump({p: json.load(open(p)) for p in sorted(glob.glob(sys.argv[1]))}, open(sys.argv[2], 'w'), indent=1)" \
    "$W/acc_*.json" "$OUT/acceptance.json"
tail -n 4 "$W"/*.txt
