#!/usr/bin/env bash
# Benchmark (not a test): activation checkpointing modes side by side in one run, on the
# llama3 debugmodel (dense) and the llama4 debugmodel (MoE, loop experts): none, full,
# selective every 2nd block, and selective op. Prints, per mode, the median training
# tokens/s over the steps after the first two, the peak allocated memory of those steps
# (metrics.jsonl memory_peak_gib: the counting CPU allocator, or CUDA's when on a GPU), and
# both as ratios to `none`. The modes are run in rotation, AC_BENCH_ROUNDS times (default 2),
# and the best tokens/s of the rounds kept, so machine noise hits all alike.
# Usage: scripts/bench_ac.sh [STEPS] [BATCH] [SEQ]   (TITAN_SKIP_BUILD=1: no build first)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TITAN_BUILD_DIR:-$root/build}"
[ "${TITAN_SKIP_BUILD:-0}" = 1 ] || TITAN_BUILD_DIR="$build" "$root/scripts/build.sh" >/dev/null
source "${TITAN_CACHE:-$HOME/.cache/titan-train}/env.sh"
steps=${1:-8} batch=${2:-4} seq=${3:-1024}
threads=${OMP_NUM_THREADS:-$(nproc)}
export OMP_NUM_THREADS=$threads
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

declare -A modes=(
  [none]="--activation_checkpoint.mode none"
  [full]="--activation_checkpoint.mode full"
  [sel2]="--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2"
  [op]="--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
)
order="none full sel2 op"

run() {  # config mode round -> one JSON line {tps, peak_gib, loss}
  local out="$work/$1-$2-$3"
  # shellcheck disable=SC2086
  "$build/titan-train" --config "$root/configs/$1" --training.steps "$steps" \
    --training.local_batch_size "$batch" --training.seq_len "$seq" --metrics.log_freq 1 \
    --validation.enable false --metrics.enable_tensorboard false --moe.experts_backend loop \
    --job.dump_folder "$out" ${modes[$2]} >"$out.log" 2>&1 || { cat "$out.log"; exit 1; }
  "$TITAN_PYTHON" - "$out/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"tps"' in l]
later = rows[2:] or rows
print(json.dumps({"tps": statistics.median(r["tps"] for r in later),
                  "peak_gib": max(r["memory_peak_gib"] for r in later),
                  "loss": rows[-1]["loss"]}))
PY
}

for config in llama3_debug.toml llama4_debug.toml; do
  results="$work/$config.jsonl"
  for round in $(seq "${AC_BENCH_ROUNDS:-2}"); do
    for m in $order; do echo "{\"mode\": \"$m\", \"r\": $(run "$config" "$m" "$round")}" >>"$results"; done
  done
  "$TITAN_PYTHON" - "$results" "$config" "$threads" "$steps" "$batch" "$seq" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
best = {}
for row in rows:
    m, r = row["mode"], row["r"]
    if m not in best or r["tps"] > best[m]["tps"]:
        best[m] = dict(r, peak_gib=min(r["peak_gib"], best.get(m, r)["peak_gib"]))
base = best["none"]
print(f"{sys.argv[2]}: {sys.argv[3]} threads, {sys.argv[4]} steps, batch {sys.argv[5]} x seq {sys.argv[6]}")
print(f"  {'mode':<14}{'tokens/s':>10}{'vs none':>9}{'peak GiB':>10}{'vs none':>9}{'last loss':>11}")
names = {"none": "none", "full": "full", "sel2": "selective 2", "op": "selective op"}
for m in ["none", "full", "sel2", "op"]:
    r = best[m]
    print(f"  {names[m]:<14}{r['tps']:>10.0f}{r['tps'] / base['tps']:>8.2f}x"
          f"{r['peak_gib']:>10.3f}{r['peak_gib'] / base['peak_gib']:>8.2f}x{r['loss']:>11.5f}")
PY
done
