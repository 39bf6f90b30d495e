#!/usr/bin/env bash
# Benchmark (not a test): DualPipeV's overlapped forward + backward pairs against the same
# pairs run one after the other (parallel.pipeline_parallel_expert_parallel_overlap), side
# by side in one run: PP 2 x EP 2 on 4 CPU ranks (gloo, 1 thread each), an MoE debug model
# (default llama4). Prints per setting the median over the steps after the first two of
# rank 0's tokens/s and of its comm_wait_ms (the time compute waited at collectives: the
# expert all-to-alls, the pipeline's sends and receives, FSDP's), and the ratios overlap on
# / off. Settings run in rotation BENCH_ROUNDS times (default 2); the best tokens/s of the
# rounds is kept. On 2 cores 4 ranks share the CPU, so the waits are mostly other ranks'
# compute: read the ratio as what this machine shows, not a GPU's gain.
# Usage: scripts/bench_ep_overlap.sh [MODEL] [STEPS] [BATCH] [SEQ]   (TITAN_SKIP_BUILD=1: no build)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" "$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
model=${1:-llama4} steps=${2:-8} batch=${3:-8} seq=${4:-256}
export OMP_NUM_THREADS=1
torchrun="$(dirname "$TITAN_PYTHON")/torchrun"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

common="--model.name $model --parallelism.pipeline_parallel_degree 2
  --parallelism.expert_parallel_degree 2 --parallelism.pipeline_parallel_schedule DualPipeV
  --parallelism.pipeline_parallel_layers_per_stage 2 --training.local_batch_size $batch
  --training.global_batch_size $((2 * batch))"
declare -A settings=(
  [on]="--parallelism.pipeline_parallel_expert_parallel_overlap true"
  [off]="--parallelism.pipeline_parallel_expert_parallel_overlap false"
)

run() {  # setting round -> one JSON line {tps, wait, loss}
  local out="$work/$1-$2"
  # shellcheck disable=SC2086
  "$torchrun" --standalone --nproc_per_node 4 --no-python "$build/titan-train" \
    --config "$root/configs/llama3_debug.toml" $common --training.steps "$steps" \
    --training.seq_len "$seq" --training.device cpu --metrics.log_freq 1 \
    --validation.enable false --metrics.enable_tensorboard false \
    --job.dump_folder "$out" ${settings[$1]} >"$out.log" 2>&1 || { cat "$out.log"; exit 1; }
  "$TITAN_PYTHON" - "$out/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tps"' in l]
later = rows[2:] or rows
print(json.dumps({"tps": statistics.median(r["tps"] for r in later),
                  "wait": statistics.median(r["comm_wait_ms"] for r in later),
                  "loss": rows[-1]["loss"]}))
PY
}

results="$work/results.jsonl"
for round in $(seq "${BENCH_ROUNDS:-2}"); do
  for s in on off; do echo "{\"s\": \"$s\", \"r\": $(run "$s" "$round")}" >>"$results"; done
done
"$TITAN_PYTHON" - "$results" "$model" "$steps" "$batch" "$seq" <<'PY'
import json, sys
best = {}
for row in map(json.loads, open(sys.argv[1])):
    s, r = row["s"], row["r"]
    if s not in best or r["tps"] > best[s]["tps"]:
        best[s] = r
model, steps, batch, seq = sys.argv[2:6]
print(f"{model} debugmodel, PP 2 x EP 2 on 4 CPU ranks (gloo, 1 thread each), DualPipeV, "
      f"{batch} micro-batches of 1 x seq {seq} per pipeline, {steps} steps")
print(f"{'pairs':<12}{'tokens/s':>10}{'comm_wait_ms':>14}{'loss':>9}")
for s in ("on", "off"):
    r = best[s]
    print(f"{'overlapped' if s == 'on' else 'sequential':<12}{r['tps']:>10.0f}{r['wait']:>14.1f}"
          f"{r['loss']:>9.4f}")
on, off = best["on"], best["off"]
print(f"overlapped / sequential: tokens/s {on['tps'] / off['tps']:.2f}x, comm_wait_ms "
      f"{on['wait'] / off['wait'] if off['wait'] else float('nan'):.2f}x; "
      f"losses equal: {on['loss'] == off['loss']}")
PY
