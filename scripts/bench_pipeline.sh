#!/usr/bin/env bash
# Benchmark (not a test): pipeline schedules on 2 CPU ranks (gloo), side by side in one run,
# on the llama3 debugmodel, against FSDP 2 on the same global batch. Prints, per layout, the
# median tokens/s per rank over the steps after the first two, as a ratio to FSDP 2, and for
# the pipelines rank 0's bubble: as scheduled (unit ticks, backward = 2 forwards; for GPipe
# and 1F1B (p-1)/(m+p-1)) and as measured (1 - time in compute / time in the schedule,
# host clock). Layouts run in rotation PP_BENCH_ROUNDS times (default 2); the best tokens/s
# of the rounds is kept, so machine noise hits all alike. PP_BENCH_ORDER picks layouts (it
# must hold fsdp2, the baseline of the ratio), e.g. "fsdp2 zbv izb".
# Usage: scripts/bench_pipeline.sh [STEPS] [BATCH] [SEQ]   (TITAN_SKIP_BUILD=1: no build first)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" "$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
steps=${1:-8} batch=${2:-8} seq=${3:-256}
export OMP_NUM_THREADS=1  # 2 ranks on a 2-core machine
torchrun="$(dirname "$TITAN_PYTHON")/torchrun"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

pp="--parallelism.pipeline_parallel_degree 2 --training.local_batch_size $batch"
two="--parallelism.pipeline_parallel_layers_per_stage 2"
declare -A layouts=(
  [fsdp2]="--training.local_batch_size $((batch / 2))"
  [gpipe]="$pp --parallelism.pipeline_parallel_schedule GPipe"
  [1f1b]="$pp --parallelism.pipeline_parallel_schedule 1F1B"
  [interleaved]="$pp --parallelism.pipeline_parallel_schedule Interleaved1F1B $two"
  [izb]="$pp --parallelism.pipeline_parallel_schedule InterleavedZeroBubble $two"
  [zbv]="$pp --parallelism.pipeline_parallel_schedule ZBVZeroBubble $two"
  [dualpipev]="$pp --parallelism.pipeline_parallel_schedule DualPipeV $two"
)
order="${PP_BENCH_ORDER:-fsdp2 gpipe 1f1b interleaved izb zbv dualpipev}"

run() {  # layout round -> one JSON line {tps, scheduled, measured, loss}
  local out="$work/$1-$2"
  # shellcheck disable=SC2086
  "$torchrun" --standalone --nproc_per_node 2 --no-python "$build/titan-train" \
    --config "$root/configs/llama3_debug.toml" --training.steps "$steps" \
    --training.seq_len "$seq" --training.device cpu --metrics.log_freq 1 \
    --validation.enable false --metrics.enable_tensorboard false \
    --job.dump_folder "$out" ${layouts[$1]} >"$out.log" 2>&1 || { cat "$out.log"; exit 1; }
  "$TITAN_PYTHON" - "$out/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tps"' in l]
later = rows[2:] or rows
med = lambda k: statistics.median(r[k] for r in later) if k in later[0] else -1
print(json.dumps({"tps": med("tps"), "scheduled": med("pp/bubble_scheduled"),
                  "measured": med("pp/bubble_measured"), "loss": rows[-1]["loss"]}))
PY
}

results="$work/results.jsonl"
for round in $(seq "${PP_BENCH_ROUNDS:-2}"); do
  for l in $order; do echo "{\"layout\": \"$l\", \"r\": $(run "$l" "$round")}" >>"$results"; done
done
"$TITAN_PYTHON" - "$results" "$steps" "$batch" "$seq" <<'PY'
import json, sys
best = {}
for row in map(json.loads, open(sys.argv[1])):
    l, r = row["layout"], row["r"]
    if l not in best or r["tps"] > best[l]["tps"]:
        best[l] = r
steps, batch, seq = sys.argv[2:5]
print(f"llama3 debugmodel on 2 CPU ranks (gloo, 1 thread each): global batch {batch} x seq {seq}, "
      f"{steps} steps; pipelines: {batch} micro-batches of 1")
print(f"{'layout':<13}{'tokens/s/rank':>14}{'vs FSDP 2':>11}{'bubble scheduled':>18}"
      f"{'measured':>10}{'loss':>9}")
base = best["fsdp2"]["tps"]
for l, r in best.items():
    sched = f"{r['scheduled']:.3f}" if r["scheduled"] >= 0 else "-"
    meas = f"{r['measured']:.3f}" if r["measured"] >= 0 else "-"
    print(f"{l:<13}{r['tps']:>14.0f}{r['tps'] / base:>10.2f}x{sched:>18}{meas:>10}{r['loss']:>9.4f}")
PY
